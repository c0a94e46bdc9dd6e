"""Settings of the quantization of a final model (`cortiq recode`, the flows' re-encode stage)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings_meta import BATCH, WINDOW, check, setting

#: how the q4/q8 blocks of a model's linear weights are chosen
METHODS = ("gptq", "rtn", "awq")
#: the codecs GPTQ (and AWQ's scales) write; every other codec is round-to-nearest
BLOCK_CODECS = ("q4", "q4_64", "q8")
#: which decoder layers' down_proj a 4-bit file keeps at q8 (cortiq.quant.layers.more_bits)
DOWN_8BIT = ("none", "ends", "all")
#: the block codecs of 8 bits, which take `method_8bit` rather than `method`
EIGHT_BIT = ("q8",)


@dataclass
class QuantSettings:
    """Quantization of a model's linear weights into a block codec (q4, q4_64, q8)."""

    #: "gptq": each linear weight of every decoder layer by GPTQ from the Grams of its inputs over calibration
    #: windows of the data, layer by layer on the outputs of the layers already quantized; "awq": the same with
    #: activation-aware per-input-channel scales searched first and folded into the op before (RMSNorm weight,
    #: up_proj rows); "rtn": round-to-nearest, no data (the codec's own encode)
    #: the default is awq by measurement (bench/QUALITY.md, "Codecs of the healed model": on SmolLM2-135M pruned
    #: 25 % and healed, q4 awq cost less than q4 gptq on each of five texts, the pydoc, program source and licence
    #: texts of other sources among them, for little more time)
    method: str = setting("awq", "how the q4/q4_64 blocks are chosen (q8: method_8bit): gptq (from the Grams of calibration windows, "
                                  "layer by layer), awq (activation-aware scales folded into the op before, then "
                                  "GPTQ), rtn (round-to-nearest, no data)", choices=METHODS)
    #: q8 by rounding to nearest is as good as f16 on every text measured (bench/QUALITY.md, "Codecs of
    #: the healed model": SmolLM2-135M pruned 25 % and healed, five texts of four sources), so the
    #: Grams' forward and GPTQ buy it nothing a user could see; on 2 CPU cores they cost `make demo` 132 s
    method_8bit: str = setting("rtn", "how q8 blocks are chosen (method applies below 8 bits): rtn by default, "
                                      "gptq or awq to calibrate q8 as well", choices=METHODS, added=True)
    #: below 8 bits, the down_proj of some decoder layers written at q8 instead (cortiq.quant.layers.more_bits):
    #: the MLP's output matrix, which the pruning narrowed and the residual stream adds in whole. "ends" by
    #: measurement (bench/QUALITY.md, "down_proj at q8": SmolLM2-135M pruned 25 % and healed, q4 by AWQ, scored
    #: on the heal source's held-out text, unseen plays, pydoc, program source and licence text): of none, "ends"
    #: and "all", "ends" is the cheapest that keeps every text within 0.05 nats of f16. In the key (no `added`): a
    #: q4 cached before it had every down_proj in q4
    down_8bit: str = setting("ends", "below 8 bits, the layers whose down_proj stays at q8: none, ends (the first and "
                                     "last eighth and every third layer between), all", choices=DOWN_8BIT)
    # ── calibration (the windows the Grams are taken over) ──
    window: int = setting(256, "tokens per calibration window", **WINDOW)
    #: 64 windows of 256: 16k tokens, ten times the rows of SmolLM2's widest input (1536)
    max_windows: int = setting(64, "most calibration windows (0: every train window)", lo=0)
    batch: int = setting(4, "calibration windows per forward", **BATCH)
    # ── GPTQ ──
    block: int = setting(128, "GPTQ: columns per lazy-update block", lo=1)
    damp: float = setting(0.01, "GPTQ: Hessian dampening, times the mean of its diagonal", gt=0)
    #: on: the grids come from the original weights (static groups), so the error feedback cannot widen a
    #: group's range; measured on the bundled SmolLM2-135M's weights and Grams (layers 3, 14, 27) in q8, its
    #: output error under the Gram was 0.10-0.39x round-to-nearest's, 0.13-0.42x without act-order (that
    #: model's matrices already sit on a 4-bit grid of 32, which q4's rounding reproduces: no q4 measure there;
    #: a healed model's are off it)
    act_order: bool = setting(True, "GPTQ: quantize columns by decreasing Hessian diagonal, grids from the "
                                    "original weights (--no-act-order: grids as GPTQ reaches each group)")
    #: each group's q4/q8 grid searched among shrunk ranges, each refitted to its codes by least squares
    #: weighted by diag H (cortiq.compress.gptq_solver._searched_grid); 1: the group's min/max grid.
    #: Measured on Student-t weights with random input energies: q4's weighted rounding error 0.84x
    #: the min/max grid's with 11, 0.88x with 2 (the refits alone); q8 0.97x
    clip_grid: int = setting(1, "grids: range shrink factors tried per group, from 1 down to 0.5, each refitted "
                                "by weighted least squares (1: the group's min/max grid)", lo=1, hi=101, added=True)
    #: "symmetric": every q4 / q4_64 block, whichever the method (the codec's rounding for rtn and for the
    #: matrices GPTQ does not reach, each group's grid, searched and refitted, for gptq and awq), has
    #: min = −8·scale exactly in f16: the signed int4 of compressed-tensors, so `cortiq export --to hf` packs
    #: every such matrix as 4-bit with cortiq's values, where an asymmetric one goes dequantized (docs/export.md,
    #: "Quantized Hugging Face exports"). The bytes stay q4's (GGUF Q4_1 as before). Asymmetric stays the
    #: default until a healed model measures what the symmetric grid costs (bench/QUALITY.md, "A symmetric q4
    #: grid"). q8 is symmetric already: no effect on it
    q4_grid: str = setting("asymmetric", "where q4 blocks lie: asymmetric (each block's min and max), symmetric "
                                         "(min −8·scale: the int4 grid an HF export packs exactly, as 4-bit)",
                           choices=("asymmetric", "symmetric"), added=True)
    # ── AWQ ──
    #: exponents α tried per group of weights sharing an input, s = diag(G)^α (0: no scaling, plain GPTQ)
    awq_grid: int = setting(11, "AWQ: exponents tried in [0, 1] (evenly spaced, 0 included)", lo=2, hi=101,
                            when=lambda s: s.method == "awq")
    # ── resources (how, not what: outside every digest) ──
    device: str = setting("auto", "where the calibration forward and GPTQ run: auto (CUDA when present), cpu, cuda, "
                                  "cuda:N", how=True)

    def __post_init__(self):
        check(self, "quant settings")

    def method_for(self, codec: str) -> str:
        """The method that writes `codec`: `method_8bit` for q8, `method` below 8 bits."""
        return self.method_8bit if codec in EIGHT_BIT else self.method


def check_window(s: QuantSettings, arch, model, name: str = "quant.window") -> None:
    """Calibration windows no longer than `model`'s context (its `arch`): a longer one is
    positions the model was never trained at, and a layer's Grams cost grows with it."""
    from ..errors import CortiqError

    ctx = int(arch.max_position_embeddings)
    if s.window > ctx:
        raise CortiqError(f"{model}: {name} {s.window} is past the model's context of {ctx} tokens "
                          "(max_position_embeddings)")
