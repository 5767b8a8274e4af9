"""Parallelism, one module per kind: the process groups and the device mesh of a run (`process_group`), FSDP2
sharding with activation checkpointing and compilation (`fsdp`), context parallelism: a row split over ranks and
attention over the gathered keys (`context`), expert parallelism: the all-to-all dispatch of routed experts
(`experts`), the run's model built and placed on this rank (`model_setup`), and the liveness of the other ranks
(`heartbeat`). Each kind passes its kernels into the model; `lmforge.model` never imports this package."""
