"""The training loop: the `Trainer` and its step (`trainer`), the micro-batch loop with its non-finite handling
(`micro_batches`), the step's reduction and metrics (`metrics`, `flops`), per-rank logs (`logs`), stop signals
(`preemption`), host memory settings of CPU runs (`host_memory`), and the optional parts of a run (`callbacks/`)."""
