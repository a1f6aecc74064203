"""The engine: three stages with one named type at each boundary (vLLM V1's layout).

``input_processor`` (validate once, tokenize -> ``EngineCoreRequest``) -> ``core`` (``EngineCore``: scheduler, KV-cache
manager and model runner stepped as one loop -> ``EngineCoreOutput`` s; in this process, or in its own through
``core_proc`` / ``core_client``) -> ``output_processor`` (detokenize, stop strings, logprobs, n / best_of / beam search
as the user sees them -> ``RequestOutput``). ``llm_engine.LLMEngine`` composes them; ``messages`` is the one wire
schema (msgspec); ``beam_search`` is the core's beam policy; ``core_setup`` builds a core; ``detokenizer`` and
``generation_config`` serve the output and input sides."""
