"""transformers running cortiq's Hugging Face exports on a device: loaded quantized, scored as cortiq scores.

    python -m bench.quality.hf_run --out DIR [--model M.cmf]   # one GPU: SmolLM2 (or M), f16 / q8 / q4
    python -m bench.quality.hf_run --cpu --tiny --out DIR      # the code paths

The model (default the bundled SmolLM2-135M-Instruct, converted) in three codecs: as it is, q8 and q4 on
the symmetric grid (`cortiq recode --method rtn`, `--q4-grid symmetric`: the int4 an export packs exactly).
Each is written by `cortiq export --to hf --dtype f16` and loaded by transformers' AutoModelForCausalLM on
the device in f32. Per codec:
- the bytes of the export's decoder layers (every tensor under model.layers.: the linear layers and
  their norms; the tied embedding stays 16-bit), and their share of the f16 export's;
- how the decoder's linear layers arrive, and how they run after the first forward: packed
  (compressed-tensors' int32 words and scales, no dense weight) or dense;
- the device memory the loaded model holds before its first forward, and after it: transformers
  with compressed-tensors decompresses a packed model on its first forward pass (its
  `ct_decompress_hook`), so this says what the runtime keeps while it runs;
- the NLL of transformers' logits and of cortiq's own forward of the same CMF file, on windows of
  the pydoc text's test split, and their difference.
Results: DIR/hf_run.json and a Markdown table.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.common import finish, log, parser, print_table, pydoc_tdata, smollm2_cmf, tiny_cmf, write_json
from bench.quality.sizes import cortiq, disk_bytes

#: codec → the `cortiq recode` arguments (None: the model as it is)
CODECS = {
    "f16": None,
    "q8": ["--codec", "q8", "--method", "rtn"],
    "q4 symmetric": ["--codec", "q4", "--method", "rtn", "--q4-grid", "symmetric"],
}


def decoder_bytes(folder: Path) -> int:
    """Bytes of the tensors under model.layers. in a Hugging Face directory's safetensors files."""
    from safetensors import safe_open

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if k.startswith("model.layers."):
                    t = st.get_slice(k)
                    n += math.prod(t.get_shape()) * {"I32": 4, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1,
                                                     "I64": 8}[t.get_dtype()]
    return n


def linear_layout(hf) -> dict[str, int]:
    """How many of the decoder's linear layers hold packed words (int32 `weight_packed`) and how many a
    dense `weight`."""
    packed = dense = 0
    for layer in hf.model.layers:
        for name, m in layer.named_modules():
            params = dict(m.named_parameters(recurse=False))
            if "weight_packed" in params:
                packed += 1
            elif "weight" in params and params["weight"].dim() == 2:
                dense += 1
    return {"packed": packed, "dense": dense}


def windows_of(td: Path, window: int, n: int, device: str):
    import numpy as np
    import torch

    from cortiq.data import Tdata, windows

    w = windows(Tdata.open(td), "test", window, loss_on="all")
    n = min(len(w), n)
    return tuple(torch.from_numpy(np.asarray(a[:n])).to(device) for a in (w.ids, w.next, w.weight))


def mean_nll(logits, nxt, wt) -> float:
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.float().flatten(0, 1), nxt.flatten(), reduction="none")
    return float((ce * wt.flatten()).sum() / wt.sum())


def memory(device: str) -> int:
    import torch

    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def one_codec(cmf: Path, hf_dir: Path, batch, device: str) -> dict:
    """transformers' and cortiq's NLL of one CMF file and its export, the layout and the memory."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from cortiq.model import load_model

    cortiq("export", cmf, "--to", "hf", hf_dir, "--dtype", "f16", "--force")
    ids, nxt, wt = batch
    transformers.logging.set_verbosity_error()
    base = memory(device)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
        row = {"layout": linear_layout(hf), "mem_loaded": memory(device) - base}
        row["nll_transformers"] = mean_nll(hf(ids).logits, nxt, wt)
        row["mem_running"], row["layout_running"] = memory(device) - base, linear_layout(hf)
        del hf
        row["nll_cortiq"] = mean_nll(load_model(cmf, dtype=torch.float32, device=device)(ids), nxt, wt)
    row["decoder_bytes"] = decoder_bytes(hf_dir)
    row["export_bytes"] = disk_bytes(hf_dir)
    return row


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="the CMF model (default: the bundled SmolLM2, converted)")
    ap.add_argument("--cache", default=None, help="models and exports (default ~/cache/hf_run)")
    ap.add_argument("--windows", type=int, default=16, help="test windows scored")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    work = Path(args.cache or Path.home() / "cache" / ("hf_run-tiny" if args.tiny else "hf_run"))
    work.mkdir(parents=True, exist_ok=True)
    src = Path(args.model) if args.model else tiny_cmf(work / "tiny.cmf") if args.tiny else smollm2_cmf()
    td = pydoc_tdata(src, work / "td", 40_000 if args.tiny else 200_000, record_tokens=128 if args.tiny else 512)
    batch = windows_of(td, 64 if args.tiny else 512, args.windows, device)
    rows = {}
    for codec, recode in CODECS.items():
        cmf = src if recode is None else work / f"model-{codec.replace(' ', '-')}.cmf"
        if recode is not None:
            cortiq("recode", src, cmf, *recode, "--force")
        rows[codec] = one_codec(cmf, work / f"hf-{codec.replace(' ', '-')}", batch, device)
        log(f"{codec}: {rows[codec]}")
    import torch

    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    write_json(args.out, "hf_run.json", {"device": dev_name, "tiny": args.tiny, "model": src.name, "rows": rows})
    f16 = rows["f16"]["decoder_bytes"]
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    print(f"\ntransformers on {dev_name}, {src.name}")
    print_table(["codec", "decoder MB (of f16)", "linear layers loaded", "running", "memory loaded MB", "memory running MB",
                 "NLL transformers", "NLL cortiq", "Δ"],
                [[c, f"{mb(r['decoder_bytes'])} ({r['decoder_bytes'] / f16:.0%})",
                  *(f"{r[k]['packed']} packed, {r[k]['dense']} dense" for k in ("layout", "layout_running")),
                  mb(r["mem_loaded"]),
                  mb(r["mem_running"]), f"{r['nll_transformers']:.5f}", f"{r['nll_cortiq']:.5f}",
                  f"{r['nll_transformers'] - r['nll_cortiq']:+.1e}"] for c, r in rows.items()])
    return 0


if __name__ == "__main__":
    finish(main())
