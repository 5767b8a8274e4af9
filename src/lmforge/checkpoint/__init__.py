"""Checkpoints: where they live in a run directory and how they are named, found, committed and kept (`layout`),
writing them with DCP and an atomic commit (`checkpointer`), reading them back into sharded objects (`load`),
the payload's plain tensors (`payload`), each rank's RNG state (`rng_state`), readers that run no code from a
checkpoint a user names (`safe_load`), and the run directory before the step loop: start, resume or start over
(`run_dir`).

`layout` and `run_dir` import no torch at module level, so the light commands (`lmforge slurm`) can use them."""
