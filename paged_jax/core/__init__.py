"""The engine core's scheduling side: the ``Scheduler`` (``scheduler``: token budget, chunked prefill, admission,
preemption, stop rules), the KV block pool with prefix caching, forks and swap (``kv_cache_manager``), the one
request state inside the core (``request``), the step contract handed to the model runner (``sched_output``:
``SchedulerOutput`` as a diff of the runner's persistent batch) and hand-built steps for driving a runner without
the scheduler (``hand_steps``)."""
