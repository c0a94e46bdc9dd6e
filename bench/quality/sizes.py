"""Bytes and parameters of a compressed model in each format a runtime loads.

    python -m bench.quality.sizes --out DIR            # SmolLM2-135M-Instruct, on the CPU (bytes need no GPU)
    python -m bench.quality.sizes --cpu --tiny --out DIR   # the code paths

The source (the bundled SmolLM2, converted to CMF) is compressed at the defaults but with uniform widths
(`--fold-scope per_layer`, 25 % of the MLP neurons pruned, ranked by activation score: the size does
not depend on which neurons are kept), then re-encoded to q8 and q4 by round to nearest, and q4 on the
symmetric grid (`--q4-grid symmetric`: the blocks an HF export packs as int4 exactly). Each of the
four is written as CMF, a Hugging Face directory at f16 (`--quantized none`), a quantized Hugging Face
directory (`--quantized exact`, then `all`: compressed-tensors pack-quantized; docs/export.md) and a
GGUF. Per model and format: the bytes on disk and the parameters (weights, not bytes: a q4 weight
is one parameter). Results: DIR/sizes.json and a Markdown table.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import finish, log, parser, print_table, pydoc_tdata, smollm2_cmf, tiny_cmf, write_json

#: format → the `cortiq export` arguments that write it (None: the CMF itself)
FORMATS = {
    "CMF": None,
    "HF f16": ["--to", "hf", "{out}", "--dtype", "f16", "--quantized", "none"],
    "HF quantized (exact)": ["--to", "hf", "{out}", "--dtype", "f16", "--quantized", "exact"],
    "HF quantized (all)": ["--to", "hf", "{out}", "--dtype", "f16", "--quantized", "all"],
    "GGUF": ["--to", "gguf", "{out}"],
}


def disk_bytes(path: Path) -> int:
    """A file's bytes, or the sum over a folder's files."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def parameters(cmf: Path) -> int:
    from cortiq.cmf import open_cmf

    f = open_cmf(cmf)
    n = 0
    for name in f.names:
        shape = f.info(name).shape
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def cortiq(*args) -> None:
    from cortiq.cli import main

    rc = main([str(a) for a in args])
    if rc:
        raise SystemExit(f"cortiq {' '.join(map(str, args))}: exit {rc}")


def models(src: Path, work: Path, tiny: bool) -> dict[str, Path]:
    """The source, its uniform-width student, and the student at q8 and q4."""
    td = pydoc_tdata(src, work / "td", 40_000 if tiny else 200_000, record_tokens=128 if tiny else 512)
    student = work / "student.cmf"
    cortiq("compress", src, "--data", td, "--keep-frac", "0.75", "--fold-scope", "per_layer", "--no-learn-masks",
           "--device", "cpu", "--out", student, "--work", work / "stages", *(["--grams-max-windows", "4"] if tiny else []))
    out = {"source": src, "compressed": student}
    for codec, grid in (("q8", []), ("q4", []), ("q4 symmetric", ["--q4-grid", "symmetric"])):
        out[f"compressed {codec}"] = work / f"student-{codec.replace(' ', '-')}.cmf"
        cortiq("recode", student, out[f"compressed {codec}"], "--codec", codec.split()[0], "--method", "rtn", *grid)
    return out


def sizes(named: dict[str, Path], work: Path) -> list[dict]:
    rows = []
    for label, cmf in named.items():
        row = {"model": label, "parameters": parameters(cmf), "bytes": {}}
        for fmt, args in FORMATS.items():
            if args is None:
                row["bytes"][fmt] = disk_bytes(cmf)
                continue
            out = work / "exports" / f"{label.replace(' ', '-')}-{fmt.split()[0].lower()}{len(row['bytes'])}"
            cortiq("export", cmf, *[a.format(out=out) for a in args], "--force")
            row["bytes"][fmt] = disk_bytes(out)
            log(f"{label} {fmt}: {row['bytes'][fmt]:,} bytes")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--cache", default=None, help="models and exports (default ~/cache/sizes)")
    args = ap.parse_args(argv)
    work = Path(args.cache or Path.home() / "cache" / ("sizes-tiny" if args.tiny else "sizes"))
    work.mkdir(parents=True, exist_ok=True)
    src = tiny_cmf(work / "tiny.cmf", layers=2) if args.tiny else smollm2_cmf()
    rows = sizes(models(Path(src), work, args.tiny), work)
    write_json(args.out, "sizes.json", {"tiny": args.tiny, "rows": rows})
    base = rows[0]["bytes"]
    print_table(["model", "parameters", *FORMATS],
                [[r["model"], f"{r['parameters']:,}",
                  *(f"{r['bytes'][f]:,} ({r['bytes'][f] / base[f]:.0%})" for f in FORMATS)] for r in rows])
    return 0


if __name__ == "__main__":
    finish(main())
