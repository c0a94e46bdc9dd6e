"""Settings of `cortiq serve` (the command's options are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CortiqError


@dataclass
class ServeSettings:
    # ── where it listens ──
    #: address to bind; the default keeps the server on this machine
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (127.0.0.1: this machine only)"})
    #: TCP port; 0 picks a free one (the address is printed on start)
    port: int = field(default=8000, metadata={"help": "TCP port (0: a free one, printed on start)"})
    #: the model id clients name; "" = the file's stem
    model_name: str = field(default="", metadata={"help": "model id served (default: the file name without .cmf)"})

    # ── decoding ──
    #: sequences decoded together; more waiting requests queue for a free slot
    max_batch: int = field(default=16, metadata={"help": "requests decoded together in one batch"})
    #: positions per sequence (prompt + answer); 0 = the model's own limit, capped at 4096
    max_len: int = field(default=0, metadata={"help": "context per request in tokens (0: the model's, at most 4096)"})
    #: greedy requests draft with the MTP block and verify in one forward (same tokens, fewer forwards)
    speculative: bool = field(default=False, metadata={"help": "speculative decoding with the model's MTP draft (greedy requests)"})
    #: tokens the MTP chain drafts per round
    draft: int = field(default=1, metadata={"help": "--speculative: tokens drafted per round"})
    #: "decode" (= auto): static buffers, one batched forward, CUDA graphs on CUDA; "loop": the
    #: model's own cache and one forward per slot (the plain reference)
    engine: str = field(default="auto", metadata={"help": "decoding engine (auto: decode)",
                                                  "choices": ("auto", "decode", "loop")})
    #: cpu, cuda, cuda:1, ... ("auto": CUDA when present)
    device: str = field(default="auto", metadata={"help": "device (auto: cuda when available)"})
    #: compute dtype; auto = bf16 on CUDA, f32 on CPU
    dtype: str = field(default="auto", metadata={"help": "compute dtype (auto: bf16 on CUDA, f32 else)",
                                                 "choices": ("auto", "f32", "bf16", "f16")})

    # ── limits ──
    #: largest request body accepted (413 above)
    max_body_kb: int = field(default=1024, metadata={"help": "largest request body in KiB"})
    #: requests that may wait for a slot (429 above)
    max_waiting: int = field(default=256, metadata={"help": "requests that may wait for a free slot"})
    #: seconds in-flight requests get after SIGTERM before they are cut
    shutdown_timeout: float = field(default=5.0, metadata={"help": "seconds running requests get after SIGTERM"})

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise CortiqError(f"serve: port {self.port} is outside 0..65535")
        for name in ("max_batch", "max_body_kb", "max_waiting", "draft"):
            if getattr(self, name) < 1:
                raise CortiqError(f"serve: {name} must be >= 1, not {getattr(self, name)}")
        if self.max_len != 0 and self.max_len < 2:
            raise CortiqError(f"serve: max_len {self.max_len} (0 or >= 2)")
        if self.engine not in ("auto", "decode", "loop"):
            raise CortiqError(f"serve: engine {self.engine!r} (auto, decode or loop)")
        if self.dtype not in ("auto", "f32", "bf16", "f16"):
            raise CortiqError(f"serve: dtype {self.dtype!r} (auto, f32, bf16 or f16)")
        if self.shutdown_timeout < 0:
            raise CortiqError(f"serve: shutdown_timeout must be >= 0, not {self.shutdown_timeout}")
