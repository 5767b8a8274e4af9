"""The embedding and the LM head split over the vocabulary (tensor parallelism): each rank of the TP group holds
vocabulary / tp consecutive rows of each.

The embedding looks up the ids in this rank's range (zeros for the others'), and the partial rows are summed and
split over tokens in one reduce-scatter, for the sequence-parallel residual stream. The out-of-range ids are
masked arithmetically: boolean indexing (as DTensor's own vocabulary-sharded embedding does) reads a count back
to the host on a GPU.

The head's inputs are made local (`vocab_shard`) for lmforge's chunked cross-entropy, which all-reduces the row
maxima, exponential sums and target logits over the group (`lmforge.model.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


@dataclass(frozen=True)
class VocabShard:
    """The LM head's share of the vocabulary on this rank under tensor parallelism (loss parallel)."""

    group: dist.ProcessGroup
    """The ranks that split the vocabulary between them."""
    start: int
    """The first token id of this rank's rows of the head."""


def sharded_embedding(ids: Tensor, weight: DTensor) -> DTensor:
    """Embeddings of `ids` [T] from a table split over the vocabulary (`weight`, `Shard(0)` on the TP mesh), as a
    DTensor holding T / tp consecutive tokens per rank (`Shard(0)`). Nothing is read back to the host."""
    local = weight.to_local()
    mesh = weight.device_mesh
    shifted = ids - mesh.get_local_rank() * local.shape[0]
    inside = (shifted >= 0) & (shifted < local.shape[0])
    rows = F.embedding(shifted.where(inside, 0), local) * inside.unsqueeze(1).to(local.dtype)
    return DTensor.from_local(rows, mesh, [Partial()]).redistribute(placements=[Shard(0)])


def vocab_shard(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, VocabShard]:
    """Under tensor parallelism, the LM head's inputs as local tensors: the hidden states [T, H] of the whole row on
    every rank (gathered from the sequence-parallel tokens; their gradient, a partial sum on each rank, is reduced
    and scattered back), this rank's rows of the head `weight` (a DTensor split over the vocabulary) and its
    `VocabShard`."""
    assert isinstance(weight, DTensor)
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=(Partial(),))
    local = weight.to_local()
    mesh = weight.device_mesh
    return hidden, local, VocabShard(mesh.get_group(), mesh.get_local_rank() * local.shape[0])
