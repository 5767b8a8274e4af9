"""`lmforge` that also saves every micro-batch each rank trains on, for the replay tests.

    CAPTURE_DIR=DIR python tests/integration/capture_run.py lmforge-args...   (also as a torchrun script)

Each step of each rank writes `DIR/rank{R}_step{S}.npz` with the stacked input ids, target ids and loss masks of the
rank's micro-batches as the trainer received them, before anything else of the step runs. The capture hooks the
trainer, not the data code, so it records what trained whatever that code does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from lmforge.cli import main
from lmforge.train import trainer


def capture(folder: Path) -> None:
    """Patch `Trainer.train_step` to save its micro-batches into `folder`."""
    train_step = trainer.Trainer.train_step
    rank = os.environ.get("RANK", "0")

    def saving_step(self, micro_batches, *args, **kwargs):  # type: ignore[no-untyped-def]
        arrays = {name: np.concatenate([getattr(mb, name).numpy() for mb in micro_batches])
                  for name in ("input_ids", "target_ids", "loss_mask")}  # fmt: skip
        np.savez(folder / f"rank{rank}_step{self.step + 1}.npz", **arrays)
        return train_step(self, micro_batches, *args, **kwargs)

    trainer.Trainer.train_step = saving_step  # type: ignore[method-assign]


if __name__ == "__main__":
    capture(Path(os.environ["CAPTURE_DIR"]))
    sys.exit(main(sys.argv[1:]))
