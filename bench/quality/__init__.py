"""What a model keeps (bench/QUALITY.md): `quality` (how much of the pruning loss heal wins back; its panel
mode: what compress and heal keep outside the user's text), `excess` (where the excess NLL goes), `codecs`
(what each codec costs a healed model), `llamacpp` (a GGUF export scored in llama.cpp and in cortiq)."""
