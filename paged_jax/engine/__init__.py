"""The engine: ``LLMEngine`` (``llm_engine``) takes requests, validates them once against the model's limits,
steps the core (scheduler -> model runner) and turns sampled tokens into vLLM's ``RequestOutput``s. Around it:
async scheduling (``async_scheduling``: step k+1 dispatched before step k's tokens reach the host), a request's
sequences for ``n`` / ``best_of`` (``sequence_group``) and beam search above them (``beam_search``), incremental
detokenization with stop strings (``detokenizer``), the engine process's per-step stream deltas
(``step_outputs``) and the checkpoint's default sampling parameters (``generation_config``)."""
