"""`cortiq serve`: an OpenAI-compatible HTTP endpoint for CMF models.

The pieces, from the bottom up:
- `engine`: independent sequence slots decoded together (prefill a slot,
  one batched step over many slots, a speculative round with the MTP draft,
  release a slot);
- `sampling` and `detok`: batched sampling with per-request seeds, and
  text that grows token by token (stop strings, multi-byte characters);
- `scheduler`: a thread that admits requests into free slots between steps
  and retires finished ones (continuous batching), feeding asyncio queues;
- `chat`: the model's chat template rendered in a sandbox;
- `app`: the FastAPI application (imported only by the serve command, so
  `import cortiq` never loads fastapi).
"""
