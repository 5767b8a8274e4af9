"""`[parallel]`: how the ranks of a run work together."""

from __future__ import annotations

from pydantic import Field

from lmforge.config.base import Section


class ParallelConfig(Section):
    """The process group of a run on several processes."""

    cp: int = Field(default=1, ge=1)
    """Context-parallel degree: every row of a micro-batch is split over this many ranks (each holds 2 of 2 x cp
    equal chunks, so causal work is balanced), and attention gathers the row's keys and values from them. Data
    parallelism takes the rest: world size / cp groups, each training on rows of its own. Use it when one row
    (data.micro_batch_tokens) does not fit one device; see docs/training.md."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree (MoE models): each MoE block's routed experts are split over this many consecutive
    ranks, each holding experts / ep of them, and every token copy is sent to the rank holding its expert by
    all-to-all. The groups are carved out of all ranks (data- and context-parallel alike), so ep divides the world
    size and the number of routed experts. Expert weights are FSDP-sharded over the world size / ep ranks holding
    the same experts; see docs/training.md."""

    dp_replicate: int = Field(default=1, ge=1)
    """Hybrid sharding (HSDP): the ranks form this many replica groups of world size / dp_replicate consecutive
    ranks each. FSDP shards parameters, gradients and optimizer state within a group (its all-gathers and
    reduce-scatters stay inside it: put a group on one node), and gradients are all-reduced across the groups.
    Every rank still trains on rows of its own. 1 (the default) shards over every rank. Expert stacks under
    parallel.ep keep sharding over all the ranks holding the same experts; see docs/training.md."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree: every attention and dense MLP matmul is split over this many consecutive ranks
    (query and KV heads, the MLP's intermediate size, the vocabulary of the embedding and LM head), and the tokens
    between them (norms, residual stream) are split over the same ranks (sequence parallelism); MoE blocks run on
    each rank's own tokens. The ranks of a group train on the same rows; keep a group inside one node (it
    communicates in every layer). Data parallelism takes world size / (cp x tp) groups, and FSDP shards over them;
    see docs/training.md."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a rank waits in one collective (an all-reduce, a checkpoint's agreement) for the others before it
    gives up and exits, naming the ranks that stopped answering. Raise it when one rank may legitimately work alone
    for longer (a very slow first compilation on some ranks only)."""
