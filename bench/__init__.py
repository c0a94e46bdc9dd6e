"""The benchmarks: each script runs from the repository root as `python -m bench.NAME` (its GPU
run, or `--cpu --tiny`: the same code at tiny sizes on a CPU, which tests/bench runs); `common`
holds what they share and `stages` bench.run's stage code. Results and how they were measured:
bench/RESULTS.md, QUALITY.md, MTP.md and DECODE.md."""
