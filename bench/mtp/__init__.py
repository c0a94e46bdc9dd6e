"""The MTP draft (bench/MTP.md, bench/DECODE.md): `mtp` (a fresh draft trained at mtp heal's defaults and
judged where it is used), `draft_data` (which self-generated data trains it best), `selfgen` (the one
generator of self-generated text against the two it replaced), `draft_carry` (a trained draft's tensors
carried between device leases; a tool, tested in tests/bench/test_draft_carry.py)."""
