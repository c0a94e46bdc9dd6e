"""Exporters from CMF, the inverse of `cortiq.convert`.

- `cortiq.export.hf`: CMF → a Hugging Face directory (config.json with the
  family's own `model_type`, generation_config.json, tokenizer files,
  safetensors, sharded with an index over the shard limit),
  `export_hf(model_cmf, out_dir, dtype="f32")`; q8 / q4 matrices as
  compressed-tensors weights (`cortiq.convert.ct`). docs/export.md says what
  each runtime keeps of a pruned or quantized model.
- `cortiq.export.gguf`: CMF → a GGUF file llama.cpp runs (Llama, Qwen2,
  Qwen3), `export_gguf(model_cmf, out_file)`; cortiq's q8 and q4 blocks go in
  as GGUF Q8_0 and Q4_1 without re-quantization.

Both stream tensor by tensor and write `NAME.partial`, renamed when complete.
"""
