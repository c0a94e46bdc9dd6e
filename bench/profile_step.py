"""Where the student step's time goes (for bench/RESULTS.md): one device call.

    python bench/profile_step.py [--geom qwen3-1.7b]

Times the parts of heal's step at the benchmark geometry separately (the
trunk forward+backward, the fused head + top-k KL forward+backward, the Adam
update) and prints the torch profiler's top CUDA kernels of whole steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import run as R  # noqa: E402
import stages as S  # noqa: E402

from cortiq.heal.loss import topk_kl  # noqa: E402
from cortiq.heal.train import StudentTail, batch_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geom", default="qwen3-1.7b")
    a = ap.parse_args()
    g = R.GEOMS[a.geom]
    B, T, K = 4, 2048, 64
    arch = S.arch_of(g)
    H, V = g["hidden"], g["vocab"]
    dev = torch.device("cuda")
    ids = torch.randint(0, V, (B, T), device=dev)
    tids = torch.randint(0, V, (B * T, K), device=dev)
    tps = torch.softmax(torch.randn(B * T, K, device=dev), -1)
    student = S.build(arch, torch.float32)
    tail = StudentTail(student, 0, ffn_only=False, drop_prefix=False)
    student.compile_layers()
    params = [p for _, p in tail.named()]
    opt = torch.optim.Adam(params, lr=1e-5, fused=True)

    def step():
        loss = batch_loss(tail, ids, None, tids, tps, 8192, dev, torch.bfloat16)
        (loss / (B * T)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_step = R.timed(step, warm=3, reps=5)

    def trunk():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = tail.tail(tail.start(ids))
        h.float().square().mean().backward()

    t_trunk = R.timed(trunk, warm=2, reps=5)
    opt.zero_grad(set_to_none=True)
    hid = torch.randn(B * T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = student.head_weight

    def head():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            topk_kl(hid, w, tids, tps, chunk=8192).backward()

    t_head = R.timed(head, warm=2, reps=5)
    for p in params:
        p.grad = torch.zeros_like(p)
    t_adam = R.timed(lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), opt.step()), warm=2, reps=5)
    print(f"{a.geom}: step {t_step * 1e3:.1f} ms = trunk fwd+bwd {t_trunk * 1e3:.1f} + head/top-k KL fwd+bwd "
          f"{t_head * 1e3:.1f} + clip/Adam {t_adam * 1e3:.1f} (+ {(t_step - t_trunk - t_head - t_adam) * 1e3:.1f} rest)")
    opt.zero_grad(set_to_none=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
