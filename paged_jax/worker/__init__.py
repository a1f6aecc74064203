"""The model runner side: ``ModelRunner`` (``model_runner``) keeps a persistent batch (``input_batch``) updated by
each ``SchedulerOutput`` diff, packs a step from it into one host buffer (``step_packing``, layout in ``step_io``),
dispatches the jitted forward and sampler (``step_dispatch``, ``sampler``, ``top_k``) over a compiled set of shapes
(``buckets``, compiled at start-up by ``warm_up``, kept by ``executable_cache``). Also: loading the engine's model
(``model_loader``), sizing the KV pool (``kv_pool_sizing``, ``device_memory``, ``device_check``), the attention
kernel choice (``attention_impl``) and prompt logprobs (``prompt_logprobs``)."""
