"""Callbacks: the optional parts of a run, one module each, plugged into the step loop through `base.Callback`:
checkpoints (`checkpointing`), eval snapshots (`eval_snapshots`), validation (`validation`), MoE load balancing
(`balancing`), loss and gradient spike flags (`spike_flags`), a mixture's source shares (`source_shares`) and the
metrics' way to the monitors (`reporting`). `order` declares the order the loop calls them in."""
