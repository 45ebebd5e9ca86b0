"""The scheduler side: which requests run each step and how many tokens each computes
(``scheduler``), the waiting queues and preemption order (``request_queue``), n > 1 samples that
fork a first sample's prompt KV (``forks``), the per-step deltas sent to the runner
(``batch_delta``) and the types that carry them (``output``)."""
