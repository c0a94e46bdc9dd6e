"""Heal's step on the GPU (bench/RESULTS.md): `stages` (heal's stage code at a benchmark geometry, shared with
bench.run; no command line), `memory` (the memory plans against the transformers KD step, and the mask step
eager against graphed), `variants` (which fast paths pay), `profile_step` (where the step's time goes), `dist`
(one GPU against two, a sharded 8B step), `relaunch` (a stage of gpus N run from a plain process)."""
