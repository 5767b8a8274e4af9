"""`lmforge plan`: one training step of a config at a target world size, on fake tensors on the CPU, for its memory
per GPU, FLOPs, estimated step time, MFU and collective traffic (docs/plan.md)."""
