"""sgl-project/sglang's Triton MLA decode: :mod:`.decode` (stage 1 over KV splits, stage 2 merging them)."""
