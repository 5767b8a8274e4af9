"""`[parallel]`: how the ranks of a run work together."""

from __future__ import annotations

from typing import Literal

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

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree: the decoder layers are cut into stages held by this many groups of ranks (the
    embedding with the first stage, the final norm, LM head and loss with the last), and each step's micro-batches
    flow through them by `pp_schedule`. The outermost dimension: consecutive blocks of world size / pp ranks form
    one stage group each (put stage boundaries between nodes). Inside a stage group, tensor parallelism takes
    parallel.tp consecutive ranks, context parallelism the next parallel.cp, and data parallelism the rest (world
    size / (pp x cp x tp) groups); FSDP shards each stage over the group's ranks but the TP dimension. Composes with
    tp, cp, ep (inside a stage group) and dp_replicate; see docs/training.md."""

    pp_schedule: Literal["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"
    """How micro-batches move through the stages (torch.distributed.pipelining): `1f1b` (one stage per rank, one
    forward then one backward in the steady state), `interleaved_1f1b` (several stages per rank, looping: a smaller
    bubble for more point-to-point messages), `interleaved_zb` (interleaved with the backward split into its input
    and weight parts, which fill the bubble) and `zbv` (zero bubble with two stages per rank in a V: rank r holds
    stages r and 2 pp - 1 - r)."""

    pp_stages_per_rank: int | None = Field(default=None, ge=1)
    """Stages each rank holds: 1 for `1f1b` and 2 for the others when unset; `zbv` needs 2."""

    pp_layers: list[int] | None = None
    """Decoder layers per stage, first stage first (pp x stages per rank entries adding up to the model's layers);
    unset: contiguous stages balanced by compute (each layer's active matmul parameters, the LM head's with the last
    stage; the embedding, a lookup, counts nothing)."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a rank waits in one collective (an all-reduce, a checkpoint's agreement) for the others before it
    gives up and exits, naming the ranks that stopped answering. Raise it when one rank may legitimately work alone
    for longer (a very slow first compilation on some ranks only)."""
