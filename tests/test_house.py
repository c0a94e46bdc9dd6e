"""House rules the tree keeps: measured device figures live in the bench notes (bench/*.md), which the code
cites by section, not in the library or the flows; raw results lie in bench/results/, not among the scripts."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: a device named, or a speed quoted: what a bench result section holds, not a comment
FIGURE = re.compile(r"\bH[12]00s?\b|\d[\d.,]*\s*k?\s*tok(?:en)?s?/s\b")


def test_no_device_figure_in_the_library_or_the_flows():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for top in ("cortiq", "flows") for p in sorted((ROOT / top).rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if FIGURE.search(line)]
    assert not found, "cite the bench note's section instead:\n" + "\n".join(found)


def test_the_figure_rule_matches_what_it_means():
    assert FIGURE.search("on an H200") and FIGURE.search("two H100s") and FIGURE.search("645 tok/s")
    assert FIGURE.search("19.1k tok/s") and FIGURE.search("1,234 tokens/s")
    # a speed the code prints from its own measurement is no quoted figure
    assert not FIGURE.search('f"{res.tokens_per_s:.1f} tok/s"') and not FIGURE.search("tokens_per_s")


def test_raw_results_lie_in_bench_results():
    bench = ROOT / "bench"
    stray = [str(p.relative_to(ROOT)) for p in bench.rglob("*.json") if p.parent != bench / "results"]
    assert not stray, f"result files among the bench scripts (move them to bench/results/): {stray}"


def test_every_cited_result_file_exists():
    cited = {m for p in [*(ROOT / "bench").glob("*.md"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
             for m in re.findall(r"bench/results/[\w.-]+\.json", p.read_text(encoding="utf-8"))}
    assert cited and not [c for c in sorted(cited) if not (ROOT / c).exists()]


def test_no_library_file_over_700_lines_and_no_function_over_80():
    import ast
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "cortiq").rglob("*.py"))
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700]
    long_funcs = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
                  for top in ("cortiq", "flows", "tasks", "bench") for p in sorted((ROOT / top).rglob("*.py"))
                  for f in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > 80]
    assert not long_files and not long_funcs, "divide them:\n" + "\n".join(long_files + long_funcs)
