"""cortiq's own stages at a benchmark geometry (called by bench.run and bench.heal.memory).

A module, not a script: it has no command line and no smoke mode of its own;
`python -m bench.run --cpu --tiny` runs every function here.

What runs is what `cortiq heal` / `cortiq mtp heal` run: the model of
cortiq/model, the teacher's top-k through `topk_next` (row chunks, no
[rows, V] float logits), the student step with f32 master weights under bf16
autocast and the fused head + top-k KL of cortiq/heal/loss.py, fused Adam.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cortiq.arch import FULL, LINEAR, Arch
from cortiq.heal.loss import topk_kl
from cortiq.model import CausalLM

K = 64  # the teacher's top-k, as the baseline's top-64


def arch_of(g: dict) -> Arch:
    L = g["layers"]
    hybrid = g.get("hybrid", False)
    types = [LINEAR if hybrid and (i + 1) % 4 else FULL for i in range(L)]
    return Arch(
        arch_name="qwen3_5" if hybrid else "qwen3", vocab_size=g["vocab"], hidden_size=g["hidden"], num_layers=L,
        intermediate_sizes=[g["inter"]] * L, num_heads=g["heads"], num_kv_heads=g["kv"], head_dim=g["head_dim"],
        rope_theta=1e6, partial_rotary_factor=0.25 if hybrid else 1.0, qk_norm=True, attn_output_gate=hybrid,
        norm_style="offset" if hybrid else "weight", layer_types=types, tie_word_embeddings=g["tie"],
        linear_num_key_heads=g.get("lk", 0), linear_num_value_heads=g.get("lv", 0),
        linear_key_head_dim=g.get("dk", 0), linear_value_head_dim=g.get("dv", 0), mtp_layers=1,
    )


def build(arch: Arch, dtype, device="cuda") -> CausalLM:
    with torch.device(device):
        m = CausalLM(arch)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    return m.to(dtype)


def run(name, g, B, T, steps, rate, *, timed, peak_reset, peak_gib, flops_per_token, device="cuda"):
    H, L = g["hidden"], g["layers"]
    head_f = 2 * H * g["vocab"]
    c = SimpleNamespace(arch=arch_of(g), ids=torch.randint(0, g["vocab"], (B, T), device=device), B=B, T=T, H=H, L=L,
                        steps=steps, rate=rate, timed=timed, peak_reset=peak_reset, peak_gib=peak_gib, device=device,
                        head_f=head_f,
                        layer_f=(flops_per_token(g, T, False) - head_f) / L)  # forward matmul FLOPs per token per layer
    row = {"geom": name, "who": "cortiq"}
    tids, tps, h_prefix = teacher_rows(c, row)
    student_rows(c, row, tids, tps, h_prefix)
    mtp_row(c, row, tids, tps)
    return row


def teacher_rows(c, row: dict):
    """The teacher's top-k pass (bf16 weights, row chunks), the frozen prefix on the same weights, and the
    MTP trunk pass (the same pass); returns the teacher's (ids, probabilities) and the prefix's rows."""
    B, T, L, ids, device = c.B, c.T, c.L, c.ids, c.device
    teacher = build(c.arch, torch.bfloat16, device).eval()
    if device == "cuda":
        teacher.compile_layers()

    @torch.no_grad()
    def teacher_pass():
        h, _ = teacher.forward_hidden(ids)
        return teacher.topk_next(h, K, chunk=8192)

    c.peak_reset()
    s = c.timed(teacher_pass)
    row["teacher_tok_s"] = B * T / s
    row["teacher_mfu"] = (L * c.layer_f + c.head_f) * B * T / s / c.rate
    row["teacher_peak_gib"] = c.peak_gib()
    tids, tps = teacher_pass()
    tids, tps = tids.reshape(B * T, K), tps.reshape(B * T, K)

    # ── frozen prefix (half the layers) on the bf16 weights ──
    c.cut = L // 2

    @torch.no_grad()
    def prefix_pass():
        return teacher.run_layers(teacher.embed(ids), 0, c.cut)

    s = c.timed(prefix_pass)
    row["prefix_tok_s"] = B * T / s
    h_prefix = prefix_pass().float()

    # ── MTP trunk pass: hidden rows + top-k (the trunk is the teacher here) ──
    row["mtp_trunk_tok_s"] = row["teacher_tok_s"]  # the same pass: forward_hidden + topk_next, hidden kept
    del teacher
    torch.cuda.empty_cache() if device == "cuda" else None
    return tids, tps, h_prefix


def student_step(c, train_from, h0, tids, tps):
    """heal's own student step (StudentTail + batch_loss) from layer `train_from` (on the cached prefix
    rows h0, if given): f32 master weights, bf16 autocast, compiled layers, fused Adam."""
    from cortiq.heal.train import StudentTail, batch_loss

    device = c.device
    student = build(c.arch, torch.float32, device)
    tail = StudentTail(student, train_from, ffn_only=False, drop_prefix=h0 is not None)
    if device == "cuda":
        student.compile_layers(tail.running)  # a cached prefix leaves placeholders that never run
    params = [p for _, p in tail.named()]
    opt = torch.optim.Adam(params, lr=1e-5, fused=device == "cuda")
    dev = torch.device(device)

    def step():
        loss = batch_loss(tail, c.ids, h0, tids, tps, 8192, dev, torch.bfloat16 if device == "cuda" else torch.float32)
        (loss / float(c.B * c.T)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return student, step


def student_rows(c, row: dict, tids, tps, h_prefix) -> None:
    """The student step with all layers trained (as the baseline trains them), then the seed's shape: the
    tail (train_from = L/2) on the cached prefix; each with its epoch rate."""
    B, T, L = c.B, c.T, c.L
    student, step = student_step(c, 0, None, tids, tps)
    c.peak_reset()
    s = c.timed(step, warm=3, reps=c.steps)
    row["step_tok_s"] = B * T / s
    # useful FLOPs: layers fwd+bwd (3×), head fwd + grad w.r.t. hidden (2×; the head is frozen)
    row["step_mfu"] = (3 * L * c.layer_f + 2 * c.head_f) * B * T / s / c.rate
    row["step_peak_gib"] = c.peak_gib()
    # one epoch of heal = the teacher pass once + the steps over the same tokens
    row["epoch_tok_s"] = 1.0 / (1.0 / row["teacher_tok_s"] + 1.0 / row["step_tok_s"])
    del student, step
    torch.cuda.empty_cache() if c.device == "cuda" else None

    student, step = student_step(c, c.cut, h_prefix, tids, tps)
    c.peak_reset()
    s = c.timed(step, warm=3, reps=c.steps)
    row["tail_step_tok_s"] = B * T / s
    row["tail_step_peak_gib"] = c.peak_gib()
    row["tail_epoch_tok_s"] = 1.0 / (1.0 / row["teacher_tok_s"] + 1.0 / row["prefix_tok_s"] + 1.0 / row["tail_step_tok_s"])
    del student, step


def mtp_row(c, row: dict, tids, tps) -> None:
    """The MTP draft step: the block on the trunk's rows, KL to the trunk one further."""
    B, T, H, ids, device = c.B, c.T, c.H, c.ids, c.device
    student = build(c.arch, torch.float32, device)
    if device == "cuda":
        student.compile_layers()
    for p in student.parameters():
        p.requires_grad_(False)
    mparams = list(student.mtp.parameters())
    for p in mparams:
        p.requires_grad_(True)
    mopt = torch.optim.Adam(mparams, lr=2e-5, fused=device == "cuda")
    hrows = torch.randn(B, T, H, device=device)
    n = B * (T - 1)

    def mtp_step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            d = student.mtp_forward(hrows[:, :-1], ids[:, 1:])  # row p reads h_p and token p+1
            loss = topk_kl(d.reshape(n, H), student.head_weight, tids.view(B, T, K)[:, 1:].reshape(n, K),
                           tps.view(B, T, K)[:, 1:].reshape(n, K), chunk=8192) / n
        loss.backward()
        mopt.step()
        mopt.zero_grad(set_to_none=True)

    s = c.timed(mtp_step, warm=2, reps=c.steps)
    row["mtp_step_tok_s"] = n / s
    del student, mopt
