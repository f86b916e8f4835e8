"""Orbax checkpoints of the whole train state under ``<run.dir>/checkpoints/<step>/``.

Saves are asynchronous: the device arrays are copied to host and written by a background thread
while training continues; Orbax writes into a temporary directory and renames it when complete, so
a step directory that exists is a finished checkpoint. The loader needs no state of its own here:
batch i is a pure function of (seed, i), so the step alone says where the data resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from llama_jax.config import CheckpointConfig


class Checkpointer:
    def __init__(self, run_dir: Path, config: CheckpointConfig):
        self.every_steps = config.every_steps
        options = ocp.CheckpointManagerOptions(max_to_keep=config.keep, enable_async_checkpointing=True,
                                               create=True)
        self.manager = ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options,
                                             item_names=("state",))

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, state: Any) -> None:
        """Start an asynchronous save (returns once the arrays are safely copied off the device)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)

    def restore(self, step: int, abstract_state: Any) -> Any:
        """Restore into the shapes, dtypes and shardings of `abstract_state` (a ShapeDtypeStruct tree)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return restored["state"]

    def close(self) -> None:
        """Wait for pending writes, then release Orbax's threads."""
        self.manager.wait_until_finished()
        self.manager.close()


def latest_checkpoint_step(run_dir: Path) -> int:
    """Newest finished checkpoint step in run_dir (0 if none), read without creating anything.

    Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames to `<step>` when complete, so
    only all-digit directory names are finished checkpoints.
    """
    directory = run_dir / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return max(steps, default=0)
