"""The one place that says in which order the step loop calls the callbacks.

Within a step the order matters where one callback reads what another wrote:

1. `MoEBalancer` moves the routing biases from the step's global counts, before the optimizer update, and adds
   the routing metrics; `MtpLoss` sets the multi-token-prediction gradients and adds `loss/mtp/*`;
2. `SpikeFlags` flags the step's loss and gradient norm: before the checkpoint, so a checkpoint's spike history
   holds its own step;
3. `Checkpointing` saves the checkpoint (when due, or when the ranks agreed to stop), with the state the callbacks
   above left;
4. `EvalSnapshots` writes the eval worker's model-only snapshot;
5. `SourceShares` adds the per-source token counts of a mixture, `BatchHashes` the step's data fingerprint;
6. `Validation` runs the held-out sets on the updated weights;
7. callbacks passed to the `Trainer` (`EXTRA`), in the order given;
8. `Reporting` logs the step last, so it sees every metric the others added (`time/save_ckpt`, `val/*`, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

from lmforge.train.callbacks.balancing import MoEBalancer
from lmforge.train.callbacks.base import Callback
from lmforge.train.callbacks.batch_hashes import BatchHashes
from lmforge.train.callbacks.checkpointing import Checkpointing
from lmforge.train.callbacks.eval_snapshots import EvalSnapshots
from lmforge.train.callbacks.mtp import MtpLoss
from lmforge.train.callbacks.reporting import Reporting
from lmforge.train.callbacks.source_shares import SourceShares
from lmforge.train.callbacks.spike_flags import SpikeFlags
from lmforge.train.callbacks.validation import Validation

EXTRA = "extra"
"""The place of callbacks that are none of the kinds below (those passed to the `Trainer`)."""

ORDER: tuple[type[Callback] | str, ...] = (
    MoEBalancer,
    MtpLoss,
    SpikeFlags,
    Checkpointing,
    EvalSnapshots,
    SourceShares,
    BatchHashes,
    Validation,
    EXTRA,
    Reporting,
)
"""The order the step loop calls callbacks in (see the module docstring for why)."""


def place(callback: Callback) -> int:
    """The index in `ORDER` of `callback`'s kind (`EXTRA`'s for any other callback)."""
    for i, kind in enumerate(ORDER):
        if isinstance(kind, type) and isinstance(callback, kind):
            return i
    return ORDER.index(EXTRA)


def in_order(callbacks: Iterable[Callback]) -> list[Callback]:
    """`callbacks` sorted into `ORDER`; callbacks of one place keep the order they were given in."""
    return sorted(callbacks, key=place)
