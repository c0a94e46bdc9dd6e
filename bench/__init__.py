"""The workbench: GPU benchmarks grouped by what they measure, their raw results and the notes that read them.

Each script runs from the repository root as `python -m bench.GROUP.NAME` (its GPU run, or `--cpu --tiny`: the
same code at tiny sizes on a CPU, which tests/bench runs):

- `bench.run` (`make bench`): heal's stages against a plain transformers KD loop; `bench.device_check`: every
  command end to end on the device (its wheels: bench/device_wheels.sh);
- `bench.heal`: heal's step: its stage code at a benchmark geometry (`stages`), memory plans, fast-path
  variants, a profile of the step, two GPUs, the torchrun relaunch;
- `bench.pipeline`: the other stages and the whole chain: data build, compress on CUDA against the CPU, the
  pipeline stage by stage;
- `bench.quality`: what pruning, heal and the codecs cost a model, on text no stage saw;
- `bench.serve`: decoding and serving speed: the engine, its attention call, `cortiq serve` under clients;
- `bench.mtp`: the MTP draft: trained and judged, its training data, self-generated text, carried between
  device leases.

`common` holds what they share. Raw results (JSON, dated) lie in bench/results/; what they show and how they
were measured, in bench/RESULTS.md, QUALITY.md, MTP.md and DECODE.md."""
