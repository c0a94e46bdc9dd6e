"""llm-compressor's GPTQ of a Hugging Face directory, on calibration windows given as token ids.

    .venv-peer/bin/python bench/quality/peer_gptq.py --model HF_DIR --calib CALIB.safetensors \
        --bits 4 --group 32 --out OUT_DIR

Runs in the peer's own venv (`make peer`: llm-compressor and the transformers and compressed-tensors it
pins), so it imports neither cortiq nor bench: bench/quality/peer.py starts it as a subprocess and scores
what it writes with cortiq. What it writes in OUT_DIR:

- `packed/`: the compressed-tensors checkpoint llm-compressor saves (`save_compressed`): symmetric int
  weights of `--bits` in groups of `--group` inputs, pack-quantized, every Linear but lm_head; the
  rest (embedding, norms) 16-bit;
- `dense/`: the same values in f32 (each quantized weight its codes × scales, every other tensor the f16
  value `packed/` holds) and no quantization_config, for a reader that does not take the packed groups
  (cortiq reads groups of 32 and 64);
- `peer.json`: the versions, the settings and the seconds `oneshot` took.

The quantization args are llm-compressor's W4A16 / W8A16 presets (int, symmetric, group strategy, static
activation order: the GPTQ default) but for the group size, which is given, and the scale, rounded to f16
(`scale_dtype`) before GPTQ uses it: the model is quantized in f32 (the model given, not a 16-bit copy) and
saved in f16, and an f16 scale is what its checkpoint holds, so the saved codes and scales are exactly the
ones GPTQ chose.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def calibration(path: Path):
    """The windows as a datasets.Dataset of input_ids and attention_mask (one row a window)."""
    from datasets import Dataset
    from safetensors.torch import load_file

    t = load_file(str(path))
    ids, mask = t["input_ids"], t["attention_mask"]
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}), ids.shape


def recipe(bits: int, group: int, block: int, damp: float):
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group,
                            dynamic=False, scale_dtype=torch.float16)
    return GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                        ignore=["lm_head"], block_size=block, dampening_frac=damp)


def dense_copy(model, src: Path, out: Path) -> None:
    """`model` (after oneshot: each quantized weight holds its dequantized values) as a plain f32 checkpoint."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    skip = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale")
    quantized = {k[: -len("_scale")] for k in model.state_dict() if k.endswith(".weight_scale")}
    # the other tensors as the f16 checkpoint holds them: the two copies then hold the same values
    sd = {k: (v if k in quantized else v.to(torch.float16)).detach().to("cpu").float().contiguous()
          for k, v in model.state_dict().items() if not k.endswith(skip)}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json",) and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the Hugging Face directory to quantize")
    ap.add_argument("--calib", required=True, help="safetensors of input_ids and attention_mask [windows, tokens]")
    ap.add_argument("--bits", type=int, choices=(4, 8), required=True)
    ap.add_argument("--group", type=int, required=True, help="inputs per quantization group")
    ap.add_argument("--block", type=int, default=128, help="GPTQ: columns per lazy-update block")
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQ: dampening, times the mean of diag H")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(a.model), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ds, shape = calibration(Path(a.calib))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src))
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe(a.bits, a.group, a.block, a.damp),
            num_calibration_samples=shape[0], max_seq_length=shape[1], shuffle_calibration_samples=False,
            pipeline="sequential")
    secs = time.perf_counter() - t0
    dense_copy(model, src, out / "dense")
    # the checkpoint a 16-bit model's user gets: compressing re-derives each code from the weight and its
    # f16 scale, and an f16 weight (code × scale rounded) still rounds to the same code (|code| ≤ 128)
    model.to(torch.float16)
    model.save_pretrained(str(out / "packed"), save_compressed=True)
    tok.save_pretrained(str(out / "packed"))
    info = {"seconds": secs, "windows": shape[0], "window": shape[1], "bits": a.bits, "group": a.group,
            "block": a.block, "damp": a.damp, "torch_threads": torch.get_num_threads(),
            "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                         "transformers": transformers.__version__, "torch": torch.__version__}}
    (out / "peer.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
