"""OpenAI-compatible HTTP server for paged-jax.

* ``serving.app.create_app(engine, ...)``: the FastAPI app around an engine (``paged_jax.engine.llm_engine.LLMEngine``).
* ``serving.routes``: the routers (``completions``, ``chat``, ``tokenize``, ``system``); ``serving.openai_server``:
  the per-app request handling they share; ``serving.streaming``: SSE framing, stream merging, disconnects, aborts;
  ``serving.errors``: OpenAI's error body.
* ``serving.async_engine.AsyncEngine``: the engine loop on its own thread, bridged to asyncio.
* ``serving.engine_process.start_engine_process``: an ``LLMEngine`` whose core runs in a child process (the default).
* ``serving.protocol``: request/response models (OpenAI wire format plus vLLM's extras).
* ``serving.metrics.ServingMetrics``: Prometheus metrics (``paged_jax:`` prefix, vLLM's names).
* ``serving.commands.main(argv)``: the ``paged-jax`` command; ``serving.cli``: ``paged-jax serve [MODEL]`` / ``python -m serving [MODEL]``.
"""
