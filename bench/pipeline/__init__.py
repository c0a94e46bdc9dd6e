"""The other stages and the whole chain (bench/RESULTS.md): `data_build` (how fast tdata builds), `compress`
(compress on CUDA against the CPU), `pipeline` (every stage on one GPU, with heal's memory plans)."""
