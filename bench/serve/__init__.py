"""Decoding and serving speed (bench/DECODE.md): `decode` (the static-cache engine, plain and speculative,
against the reference loop and transformers), `attention` (the engine's attention call in every form torch
offers), `serve` (`cortiq serve` under concurrent streaming clients), `isolation` (what a small request
waits at `cortiq serve` while large prompts arrive)."""
