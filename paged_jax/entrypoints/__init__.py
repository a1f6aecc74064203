"""How users drive the engine without the server: vLLM's offline ``LLM`` (``llm``), chat rendering shared with the
server (``chat``) and the ``paged-jax generate`` command with its engine flags (``cli``)."""
