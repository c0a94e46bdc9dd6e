"""Facts kept under a random change of the weights, against what that change costs in NLL.

    python -m bench.quality.noise --cpu --out DIR                      # SmolLM2-135M-Instruct, f32
    python -m bench.quality.noise --cpu --facts-file EXTERNAL.tsv      # and a fact file kept outside the repo
    python -m bench.quality.noise --cpu --tiny --out DIR               # the code paths

No pruning and no training: every MLP matrix W of the source gets Gaussian noise of standard deviation
alpha * RMS(W), one draw per seed. Per alpha and seed: the excess NLL over the source on pydoc's test
split (the tokens and the measure of bench.quality.knowledge's pydoc column), and the facts kept of the
source's on the probe's dev and held parts (and the fact file), in all and of those the source is sure
of (cortiq.facts.probe.SURE_P). A compressed and healed model is read against noise of the same NLL
cost: facts it loses beyond what such noise loses went with what the fold removed, not with near-ties
that any change of the weights tips (bench/QUALITY.md, "Facts kept under random noise of the same NLL
cost"). Results: DIR/noise.json and a Markdown table.
"""

from __future__ import annotations

import copy
import time

from bench.common import CACHE, finish, log, parser, print_table, write_json


def perturbed(model, alpha: float, seed: int):
    """A copy of `model` with N(0, (alpha·RMS(W))²) added to each MLP matrix W, drawn from `seed`."""
    import torch

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                w = lin.weight
                w += alpha * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g).to(w)
    return m


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--alphas", default="0.03,0.05,0.07", help="noise scales, each a share of a matrix's RMS")
    ap.add_argument("--seeds", type=int, default=3, help="draws per scale")
    ap.add_argument("--facts-file", default=None, help="a fact TSV kept outside the repository, scored too")
    args = ap.parse_args(argv)
    import torch

    from bench.quality.quality import PANEL_CAP, panel_sets, source_model
    from cortiq.facts.probe import load_facts, probe_models, read_facts
    from cortiq.measure import score
    from cortiq.model import load_model

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    cache = CACHE / ("noise-tiny" if args.tiny else "noise")
    src_path = source_model(cache, args.tiny)
    src = load_model(src_path, dtype=torch.float32, device=device).eval()
    pydoc = panel_sets(cache, src_path, args.tiny)["pydoc"]

    def nll(m) -> float:
        return score({"m": m}, pydoc, "test", "answer", device, progress=False, max_tokens=PANEL_CAP)["m"]

    parts = {"dev": load_facts("dev"), "held": load_facts("held")}
    if args.facts_file:
        parts["external"] = read_facts(args.facts_file)
    base = nll(src)
    rows = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            m = perturbed(src, alpha, seed)
            row = {"alpha": alpha, "seed": seed, "pydoc_excess": nll(m) - base, "facts": {}}
            for part, facts in parts.items():
                c = probe_models({"source": src, "noisy": m}, facts=facts, device=device, progress=False)["models"]["noisy"]
                row["facts"][part] = {k: c[k] for k in ("source_known", "kept", "source_sure", "sure_kept")}
            rows.append(row)
            log(f"alpha {alpha:g} seed {seed}: {time.perf_counter() - t0:.0f} s")
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": args.tiny,
           "source_pydoc_nll": base, "rows": rows}
    write_json(args.out, "noise.json", res)

    def cell(c: dict, sure: bool) -> str:
        k, n = (c["sure_kept"], c["source_sure"]) if sure else (c["kept"], c["source_known"])
        return f"{k}/{n} {100 * k / n:.0f} %" if n else "-"

    head = ["alpha", "seed", "pydoc excess"] + [f"{p}{s}" for p in parts for s in ("", " (sure)")]
    print_table(head, [[r["alpha"], r["seed"], f"{r['pydoc_excess']:+.3f}"] +
                       [cell(r["facts"][p], s) for p in parts for s in (False, True)] for r in rows])
    return 0


if __name__ == "__main__":
    finish(main())
