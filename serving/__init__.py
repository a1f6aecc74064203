"""OpenAI-compatible HTTP server for paged-jax.

* ``serving.app.create_app(engine, ...)``: the FastAPI app around an ``LLMEngine``.
* ``serving.async_engine.AsyncEngine``: the engine loop on its own thread, bridged to asyncio.
* ``serving.protocol``: request/response models (OpenAI wire format plus vLLM's extras).
* ``serving.metrics.ServingMetrics``: Prometheus metrics (``paged_jax:`` prefix, vLLM's names).
* ``serving.cli.main(argv)``: ``paged-jax serve [MODEL]`` / ``python -m serving [MODEL]``.
"""
