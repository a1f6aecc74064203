"""The JAX research API: a pure, jittable, vmappable ``generate`` over the engine's model code, paged KV layout and
attention kernel (``generate``), and ``load_pretrained`` / ``score_tokens`` for evaluation code (``scoring``)."""
