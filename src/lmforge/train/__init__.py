"""The training loop: setup, micro-batches, parallelism, metrics and hooks."""
