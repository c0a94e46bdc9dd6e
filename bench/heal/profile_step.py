"""Where the student step's time goes (for bench/RESULTS.md): one device call.

    python -m bench.heal.profile_step [--geom qwen3-1.7b] [--out DIR]
    python -m bench.heal.profile_step --cpu --tiny   # the same parts at a tiny geometry on a CPU (no figures)

Times the parts of heal's step at the benchmark geometry separately (the
trunk forward+backward, the fused head + top-k KL forward+backward, the Adam
update) and prints the torch profiler's top CUDA kernels of whole steps. On
the CPU (the smoke test) the layers run eager (inductor's CPU build costs more
than the smoke test's budget) and the profiler lists CPU operators.
"""

from __future__ import annotations

import torch

from bench import run as R
from bench.heal import stages as S
from bench.common import finish, parser, print_table, write_json
from cortiq.heal.loss import topk_kl
from cortiq.heal.train import StudentTail, batch_loss


def main():
    ap = parser(__doc__)
    ap.add_argument("--geom", default="qwen3-1.7b")
    a = ap.parse_args()
    cuda = not a.cpu
    g = R.GEOMS["tiny" if a.tiny else a.geom]
    B, T, K = (4, 64, 64) if a.tiny else (4, 2048, 64)
    arch = S.arch_of(g)
    H, V = g["hidden"], g["vocab"]
    dev = torch.device("cuda" if cuda else "cpu")
    timed = R.timers(dev.type)[0]
    cdt = torch.bfloat16 if cuda else torch.float32
    ids = torch.randint(0, V, (B, T), device=dev)
    tids = torch.randint(0, V, (B * T, K), device=dev)
    tps = torch.softmax(torch.randn(B * T, K, device=dev), -1)
    student = S.build(arch, torch.float32, dev.type)
    tail = StudentTail(student, 0, ffn_only=False, drop_prefix=False)
    if cuda:
        student.compile_layers()
    params = [p for _, p in tail.named()]
    opt = torch.optim.Adam(params, lr=1e-5, fused=cuda)

    def step():
        loss = batch_loss(tail, ids, None, tids, tps, 8192, dev, cdt)
        (loss / (B * T)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_step = timed(step, warm=3, reps=5)

    def trunk():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            h = tail.tail(tail.start(ids))
        h.float().square().mean().backward()

    t_trunk = timed(trunk, warm=2, reps=5)
    opt.zero_grad(set_to_none=True)
    hid = torch.randn(B * T, H, device=dev, dtype=cdt, requires_grad=True)
    w = student.head_weight

    def head():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            topk_kl(hid, w, tids, tps, chunk=8192).backward()

    t_head = timed(head, warm=2, reps=5)
    for p in params:
        p.grad = torch.zeros_like(p)
    t_adam = timed(lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), opt.step()), warm=2, reps=5)
    opt.zero_grad(set_to_none=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=18,
                                    max_name_column_width=70))
    parts = {"step": t_step, "trunk fwd+bwd": t_trunk, "head/top-k KL fwd+bwd": t_head, "clip/Adam": t_adam,
             "rest": t_step - t_trunk - t_head - t_adam}
    write_json(a.out, "profile_step.json", {"device": str(dev), "geom": a.geom, "batch": B, "seq": T,
                                            "ms": {k: v * 1e3 for k, v in parts.items()}})
    print(f"\n{'tiny' if a.tiny else a.geom}, {B} windows of {T}, on {dev}")
    print_table(["part", "ms"], [[k, f"{v * 1e3:.1f}"] for k, v in parts.items()])
    return 0


if __name__ == "__main__":
    finish(main())
