"""Compress on CUDA against the CPU: one call, one table.

    python -m bench.pipeline.compress --data TDATA [--model smollm2|random|M.cmf] [--parts masks,overlap,stages]
                             [--reference REF] [--out DIR]
    python -m bench.pipeline.compress --data TDATA --model M.cmf --write-reference REF   # the CPU side of the overlap
    python -m bench.pipeline.compress --cpu --tiny   # every row on a tiny random model and pydoc tdata, CPU as "CUDA"

Every stage is the library's own code at the stage's default settings:
DTG-MA masks (`learn_model_masks`: window 256, batch 4, ≤ 200 steps), the
Grams (`capture_model_grams`: 64 windows of 256), the fold's least-squares
repair (`repair_down`, keep 0.75) and GPTQ (`gptq_quantize_layers`, q4, of
the repaired down projections under G[S, S]). On CUDA the forwards run under
bf16 autocast (the stage default); the CPU runs f32, on all its cores. The
masks run twice on CUDA: eager (the stage default) and with the step and the
held-out pass replayed as CUDA graphs (opt-in), their kept neurons compared.

The CPU side of each stage runs only long enough to get its rate (a few mask
steps, a few Gram windows, a few GPTQ layers); the agreement columns compare
the two on the same inputs: Gram relative error, repaired weights' relative
error, GPTQ codes equal. The kept-neuron overlap needs a whole mask run on
each side: a short schedule (the demo's: window 128, batch 2, 40 steps) run
on the CPU beforehand (`--write-reference`, any machine: it is the CPU
reference) or, without one, on this machine's CPU, against the same on CUDA.

--model smollm2 converts the bundled SmolLM2-135M GGUF (into ~/cache);
--model random is its geometry with random weights (timing only) and needs
--tokenizer-doc (the tokenizer of the model the data was built with).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import CACHE, finish, log, parser, print_table, pydoc_tdata, smollm2_cmf, tiny_cmf, write_json
from cortiq.compress.folding import mlp_names, repair_down, select_kept
from cortiq.compress.gptq_solver import gptq_quantize_layers
from cortiq.compress.grams import capture_model_grams, room_bytes
from cortiq.compress.masks import learn_model_masks
from cortiq.compress.settings import GramSettings, MaskSettings

#: the short schedule both sides of the kept-neuron overlap run in full (deployments/params/demo.yaml's)
COMPARE = dict(keep_frac=0.75, max_steps=40, lr=0.2, window=128, batch=2, val_windows=4, eval_every=5)
#: the smoke mode's smaller mask and Gram settings (empty: the stage defaults)
TINY: dict = {"masks": {}, "grams": {}}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ── the model ─────────────────────────────────────────────────────────────


def resolve_model(name: str, tokenizer_doc: str | None) -> tuple[Path, str]:
    """(CMF path, what it is)."""
    if name == "smollm2":
        return smollm2_cmf(CACHE), "SmolLM2-135M (real weights)"
    if name == "random":
        return random_smollm2(tokenizer_doc), "SmolLM2-135M geometry, random weights"
    return Path(name), name


def random_smollm2(tokenizer_doc: str | None) -> Path:
    """SmolLM2-135M's geometry (Llama, 30 layers, hidden 576, MLP 1536, 9/3 heads, vocab 49152), random bf16."""
    from cortiq.arch import Arch
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM

    if not tokenizer_doc:
        raise SystemExit("--model random needs --tokenizer-doc (the data's tokenizer)")
    out = CACHE / "smollm2-random.cmf"
    if out.exists():
        return out
    doc = json.loads(Path(tokenizer_doc).read_text())
    arch = Arch.from_dict(doc["arch"])
    torch.manual_seed(0)
    m = CausalLM(arch)
    with torch.no_grad():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    CACHE.mkdir(parents=True, exist_ok=True)
    write_cmf(out, new_doc(arch, doc["tokenizer"]), specs_from_tensors([(n, p.detach()) for n, p in m.named_parameters()], "bf16"))
    return out


# ── masks ─────────────────────────────────────────────────────────────────


def run_masks(model_path, td, s: MaskSettings, dev, compute, graph=False):
    """(result, seconds of each step, wall seconds) of learn_model_masks on `dev`."""
    from cortiq.data import windows
    from cortiq.model import load_model

    train = windows(td, "train", s.window, loss_on=s.loss_on)
    val = windows(td, "val", s.window, loss_on=s.loss_on)
    model = load_model(model_path, device=dev)
    marks = []

    def progress(step, row):
        marks.append(time.perf_counter())  # after the step's one host sync

    sync(dev)
    t0 = time.perf_counter()
    r = learn_model_masks(model, train, val, s, progress=progress, compute=compute, graph=graph)
    sync(dev)
    wall = time.perf_counter() - t0
    steps = [b - a for a, b in zip(marks, marks[1:])]
    del model
    return r, steps, wall


def step_time(steps, eval_every):
    """Median seconds of a plain step (the intervals that hold an evaluation left out)."""
    plain = [t for i, t in enumerate(steps, start=2) if (i - 1) % eval_every]
    return statistics.median(plain or steps)


def kept_overlap(a, b, keep):
    ka, kb = select_kept(a, keep), select_kept(b, keep)
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(ka, kb)) / sum(len(x) for x in ka)


def write_reference(model_path, td, out: Path):
    """The CPU side of the kept-neuron overlap: the COMPARE schedule in full, f32."""
    from safetensors.torch import save_file

    r, steps, wall = run_masks(model_path, td, MaskSettings(**COMPARE), torch.device("cpu"), torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({f"layer.{i}": t.detach().float().cpu().contiguous() for i, t in enumerate(r.logits)}, str(out / "masks.safetensors"))
    from cortiq import store

    (out / "report.json").write_text(json.dumps({"settings": COMPARE, "report": r.report(), "wall": wall,
                                                 "model_digest": store.file_digest(model_path),
                                                 "step_s": step_time(steps, COMPARE["eval_every"]),
                                                 "threads": torch.get_num_threads()}, indent=1))
    log(f"CPU reference: {r.steps} steps, {r.pruned * 100:.1f} % pruned, {wall:.1f} s -> {out}")


def read_reference(ref: Path):
    from safetensors.torch import load_file

    t = load_file(str(ref / "masks.safetensors"))
    return [t[f"layer.{i}"] for i in range(len(t))], json.loads((ref / "report.json").read_text())


# ── the bench ─────────────────────────────────────────────────────────────


def parse_args():
    """The command line; --tiny makes its own model and data and shrinks every schedule."""
    ap = parser(__doc__, cpu_help="smoke-test the bench code with the CPU as the device (measures nothing)",
                tiny_help="a tiny random model, pydoc tdata of its byte tokenizer and a few steps of everything "
                          "(no --data needed)")
    ap.add_argument("--data", help="a tdata directory built with the model's tokenizer")
    ap.add_argument("--model", default="smollm2", help="smollm2 | random | a .cmf path")
    ap.add_argument("--tokenizer-doc", default=None, help="--model random: JSON {arch, tokenizer} of the data's model")
    ap.add_argument("--reference", default=None, help="a --write-reference directory for the kept-neuron overlap")
    ap.add_argument("--write-reference", default=None, help="run the CPU side of the overlap into this directory, then stop")
    ap.add_argument("--cpu-steps", type=int, default=4, help="CPU mask steps timed (the first is not counted)")
    ap.add_argument("--cpu-gram-windows", type=int, default=8, help="windows the CPU Gram capture is timed on")
    ap.add_argument("--cpu-gptq-layers", type=int, default=2, help="layers the CPU GPTQ is timed on")
    ap.add_argument("--parts", default="masks,overlap,stages",
                    help="masks (always), overlap (kept neurons against a CPU run), stages (Grams, repair, GPTQ)")
    ap.add_argument("--steps", type=int, default=200, help="most mask steps of the timed run (the stage default)")
    a = ap.parse_args()
    if a.tiny:
        tiny = CACHE / "compress-tiny"
        a.model = str(tiny / "tiny.cmf") if (tiny / "tiny.cmf").exists() else str(tiny_cmf(tiny / "tiny.cmf"))
        a.data = str(pydoc_tdata(a.model, tiny / "pydoc.tdata", 60_000))
        a.steps, a.cpu_steps, a.cpu_gram_windows, a.cpu_gptq_layers = 6, 2, 2, 1
        COMPARE.update(max_steps=6, window=64, eval_every=3)
        TINY.update(masks=dict(window=64, batch=2, val_windows=4, eval_every=3), grams=dict(window=64, max_windows=8))
    if not a.data:
        ap.error("--data is required (or --tiny)")
    return a


def bench_masks(a, c):
    """Masks at the stage defaults: the whole run on CUDA (eager and graphed), a few steps on the CPU;
    then the CUDA graph against the eager step it replaces, the short schedule in full on each.
    Returns the eager CUDA run (the repair keeps its neurons)."""
    ms = MaskSettings(max_steps=a.steps, **TINY["masks"])
    r_gpu, st_gpu, wall_gpu = run_masks(c.path, c.td, ms, c.cuda, c.fast)
    cpu_s = MaskSettings(max_steps=a.cpu_steps, window=ms.window, batch=ms.batch, val_windows=ms.batch, eval_every=10**6)
    _, st_cpu, _ = run_masks(c.path, c.td, cpu_s, c.cpu, torch.float32)
    r_gr, st_gr, wall_gr = run_masks(c.path, c.td, ms, c.cuda, c.fast, graph=True)
    g_step, c_step, gr_step = step_time(st_gpu, ms.eval_every), statistics.median(st_cpu), step_time(st_gr, ms.eval_every)
    c.res["masks"] = {"gpu_steps": r_gpu.steps, "gpu_wall": wall_gpu, "gpu_step_s": g_step, "cpu_step_s": c_step,
                      "gpu_pruned": r_gpu.pruned, "reached": r_gpu.reached, "gpu_s_per_step_all_in": wall_gpu / r_gpu.steps,
                      "graph_step_s": gr_step, "graph_wall": wall_gr, "graph_steps": r_gr.steps}
    c.rows.append((f"DTG-MA mask step (window {ms.window} × batch {ms.batch})", f"{c_step:.3f} s",
                   f"{g_step * 1e3:.1f} ms", f"{c_step / g_step:.0f}×", "eager (the stage default)"))
    c.rows.append(("DTG-MA mask step, CUDA graph (opt-in)", "", f"{gr_step * 1e3:.1f} ms", f"{c_step / gr_step:.0f}×", ""))
    for label, r, wall in (("eager", r_gpu, wall_gpu), ("CUDA graph", r_gr, wall_gr)):
        c.rows.append((f"DTG-MA masks, whole run, {label} (load, open NLL, steps, evaluations)",
                       f"{c_step * r.steps:.0f} s†", f"{wall:.1f} s", f"{c_step * r.steps / wall:.0f}×",
                       f"{r.steps} steps, {wall / r.steps * 1e3:.0f} ms/step all in; {r.pruned * 100:.1f} % pruned"))
    cs = MaskSettings(**COMPARE)
    r_e, _, w_e = run_masks(c.path, c.td, cs, c.cuda, c.fast, graph=False)
    r_g, _, w_g = run_masks(c.path, c.td, cs, c.cuda, c.fast, graph=True)
    ov = kept_overlap([t.cpu() for t in r_e.logits], [t.cpu() for t in r_g.logits], cs.keep_frac)
    c.res["masks"]["graph_vs_eager"] = {"overlap": ov, "eager_wall": w_e, "graph_wall": w_g}
    c.rows.append(("kept neurons, short schedule, CUDA graph vs eager", "", f"{w_g:.1f} s (eager {w_e:.1f} s)", "",
                   f"overlap {ov * 100:.2f} %"))
    log(json.dumps(c.res["masks"]))
    return r_gpu


def bench_overlap(a, c) -> None:
    """The kept-neuron overlap on the short schedule: CUDA bf16 and f32 against a CPU f32 run (--reference's,
    or one run here)."""
    cs = MaskSettings(**COMPARE)
    if a.reference:
        ref_logits, ref_rep = read_reference(Path(a.reference))
        if ref_rep.get("model_digest") not in (None, c.digest):
            raise SystemExit(f"{a.reference}: a reference of model {ref_rep['model_digest']}, this model is {c.digest}")
        ref_from = f"CPU reference from elsewhere ({ref_rep['threads']} threads, {ref_rep['wall']:.0f} s)"
    else:
        r_ref, _, wall_ref = run_masks(c.path, c.td, cs, c.cpu, torch.float32)
        ref_logits, ref_from = [t.cpu() for t in r_ref.logits], f"CPU here, {wall_ref:.0f} s"
    for label, cdt in (("bf16", c.fast), ("f32", torch.float32)):
        r_c, _, wall_c = run_masks(c.path, c.td, cs, c.cuda, cdt)
        ov = kept_overlap(ref_logits, [t.cpu() for t in r_c.logits], cs.keep_frac)
        c.res[f"overlap_{label}"] = {"overlap": ov, "wall": wall_c, "pruned": r_c.pruned, "steps": r_c.steps}
        c.rows.append((f"kept neurons, short schedule, CUDA {label} vs CPU f32", "", f"{wall_c:.1f} s", "",
                       f"overlap {ov * 100:.2f} % ({ref_from}); CUDA pruned {r_c.pruned * 100:.1f} %"))
        log(json.dumps(c.res[f"overlap_{label}"]))


def bench_grams(a, c):
    """Grams at the stage defaults on CUDA, the CPU timed on --cpu-gram-windows of them and scaled.
    Returns the CUDA Grams {layer: [I, I]} and the layer count."""
    from cortiq.data import windows
    from cortiq.model import load_model

    gs = GramSettings(**TINY["grams"])
    w = windows(c.td, "train", gs.window, loss_on="all")
    n = min(len(w), gs.max_windows)
    ids = torch.from_numpy(w.ids[:n])
    rows_mask = torch.from_numpy((w.weight[:n] > 0) | (w.ids[:n] != w.pad_id))
    model = load_model(c.path, device=c.cuda)
    L = len(model.layers)
    layers = list(range(L))
    capture_model_grams(model, ids[:gs.batch], rows_mask[:gs.batch], layers, room_bytes(0, c.cuda), gs.batch,
                        compute=c.fast)  # warm-up: cuBLAS handles, allocator
    sync(c.cuda)
    t1 = time.perf_counter()
    grams, count, passes = capture_model_grams(model, ids, rows_mask, layers, room_bytes(0, c.cuda), gs.batch,
                                               compute=c.fast)
    sync(c.cuda)
    g_gram = time.perf_counter() - t1
    k = a.cpu_gram_windows
    small_gpu, _, _ = capture_model_grams(model, ids[:k], rows_mask[:k], layers, room_bytes(0, c.cuda), gs.batch,
                                          compute=c.fast)
    del model
    model = load_model(c.path)
    t1 = time.perf_counter()
    small_cpu, _, _ = capture_model_grams(model, ids[:k], rows_mask[:k], layers, room_bytes(), gs.batch)
    c_gram = (time.perf_counter() - t1) * n / k
    del model
    rel = max(float((small_gpu[l] - small_cpu[l]).norm() / small_cpu[l].norm()) for l in layers)
    c.res["grams"] = {"windows": n, "rows": count, "passes": passes, "gpu_s": g_gram, "cpu_s_scaled": c_gram, "max_rel": rel}
    c.rows.append((f"Grams, {n} windows × {gs.window} ({L} layers, f64)", f"{c_gram:.1f} s*", f"{g_gram:.2f} s",
                   f"{c_gram / g_gram:.0f}×", f"max relative difference {rel:.1e} (bf16 forward vs f32), {passes} pass"))
    log(json.dumps(c.res["grams"]))
    return grams, L


def bench_repair(c, r_gpu, grams, L: int):
    """The fold's repair (keep 0.75 by the CUDA mask), the same Grams on each side. Returns the CPU's
    repaired down projections and the kept neurons (GPTQ's input)."""
    from cortiq.cmf import open_cmf

    layers = list(range(L))
    src = open_cmf(c.path)
    kept = select_kept([t.cpu() for t in r_gpu.logits], 0.75)
    downs = [src.tensor(mlp_names(i)[2]) for i in range(L)]
    g_cuda = {l: grams[l].to(c.cuda) for l in layers}
    repair_down(downs[0], g_cuda[0], kept[0])  # warm-up: cuSOLVER handle
    sync(c.cuda)
    t1 = time.perf_counter()
    rep_gpu = [repair_down(downs[i], g_cuda[i], kept[i]) for i in layers]
    sync(c.cuda)
    g_rep = time.perf_counter() - t1
    t1 = time.perf_counter()
    rep_cpu = [repair_down(downs[i], grams[i], kept[i]) for i in layers]
    c_rep = time.perf_counter() - t1
    rel = max(float((x.cpu() - y).norm() / y.norm()) for x, y in zip(rep_gpu, rep_cpu))
    c.res["repair"] = {"gpu_s": g_rep, "cpu_s": c_rep, "max_rel": rel}
    c.rows.append((f"fold repair, {L} layers (f64 Cholesky)", f"{c_rep:.2f} s", f"{g_rep:.3f} s", f"{c_rep / g_rep:.0f}×",
                   f"max relative difference {rel:.1e}"))
    log(json.dumps(c.res["repair"]))
    return rep_cpu, kept


def bench_gptq(a, c, rep_cpu, kept, grams, L: int) -> None:
    """GPTQ q4 of the repaired down projections, the layers stacked; the CPU timed on --cpu-gptq-layers."""
    layers = list(range(L))
    Ws = torch.stack(rep_cpu)  # [L, H, k]
    Hs = torch.stack([grams[i][kept[i]][:, kept[i]] for i in layers])  # [L, k, k]
    gptq_quantize_layers(Ws[:1].to(c.cuda), Hs[:1].to(c.cuda), "q4")  # warm-up
    sync(c.cuda)
    t1 = time.perf_counter()
    q_gpu = gptq_quantize_layers(Ws.to(c.cuda), Hs.to(c.cuda), "q4")
    sync(c.cuda)
    g_q = time.perf_counter() - t1
    m = a.cpu_gptq_layers
    t1 = time.perf_counter()
    q_cpu = gptq_quantize_layers(Ws[:m], Hs[:m], "q4")
    c_q = (time.perf_counter() - t1) * L / m
    same = statistics.mean(float((x.weight.cpu() == y.weight).float().mean()) for x, y in zip(q_gpu, q_cpu))
    c.res["gptq"] = {"gpu_s": g_q, "cpu_s_scaled": c_q, "codes_equal": same}
    c.rows.append((f"GPTQ q4, {L} down projections [{Ws.shape[1]} × {Ws.shape[2]}]", f"{c_q:.1f} s*", f"{g_q:.2f} s",
                   f"{c_q / g_q:.0f}×", f"{same * 100:.3f} % of the weights identical (layers 0..{m - 1})"))
    log(json.dumps(c.res["gptq"]))


def setup(a, td):
    """The devices, the model and its digest, the result's header."""
    from cortiq import store

    assert a.cpu or torch.cuda.is_available(), "the benchmark needs a CUDA device"
    c = argparse.Namespace(td=td, cuda=torch.device("cpu" if a.cpu else "cuda"), cpu=torch.device("cpu"),
                           fast=torch.float32 if a.cpu else torch.bfloat16,  # the stage default on CUDA
                           rows=[])
    t0 = time.time()
    c.path, c.what = resolve_model(a.model, a.tokenizer_doc)
    td.check_tokenizer(c.path)
    c.digest = store.file_digest(c.path)  # the same weights as the reference's, when the digests agree
    name = "CPU (smoke test)" if a.cpu else torch.cuda.get_device_name()
    log(f"{name}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}; "
        f"model {c.what} ({c.digest}); ready in {time.time() - t0:.1f} s")
    c.res = {"device": name, "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
             "model": c.what, "model_digest": c.digest}
    return c


def main():
    from cortiq.data import Tdata

    a = parse_args()
    td = Tdata.open(a.data)
    if a.write_reference:
        path, _ = resolve_model(a.model, a.tokenizer_doc)
        write_reference(path, td, Path(a.write_reference))
        return
    c = setup(a, td)
    parts = set(a.parts.split(","))
    r_gpu = bench_masks(a, c)
    if "overlap" in parts:
        bench_overlap(a, c)
    stages = "stages" in parts
    if stages:
        grams, L = bench_grams(a, c)
        rep_cpu, kept = bench_repair(c, r_gpu, grams, L)
        bench_gptq(a, c, rep_cpu, kept, grams, L)
    res = c.res
    write_json(a.out, "compress_bench.json", res)
    print(f"\n{res['device']}, torch {res['torch']}, CPU {res['cpu_threads']} threads; {c.what}")
    print_table(["stage", "CPU", "CUDA", "speed-up", "agreement / notes"], c.rows)
    print("† the CPU's step time × the steps (no evaluations)")
    if stages and a.cpu_gram_windows:
        print("* CPU time scaled from a part (Grams: %d windows; GPTQ: %d layers)" % (a.cpu_gram_windows,
                                                                                     a.cpu_gptq_layers))


if __name__ == "__main__":
    finish(main())
