"""The engine core's scheduling side: the step contract between the scheduler and the model runner
(``sched_output``: ``SchedulerOutput`` as a diff of the runner's persistent batch, ``NewRequestData`` /
``CachedRequestData``) and hand-built steps for driving a runner without the scheduler (``hand_steps``)."""
