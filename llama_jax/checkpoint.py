"""Orbax checkpoints of the whole train state under ``<run.dir>/checkpoints/<step>/``.

Saves are asynchronous: the device arrays are copied to host and written by a background thread
while training continues; Orbax writes into a temporary directory and renames it when complete, so
a step directory that exists is a finished checkpoint. Next to the train state each step holds the
loader's state: the next step and the fingerprint of the batch stream (batch i is a pure function
of the seed, i and the data settings, so this is all it takes to resume the data exactly).
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
                                             item_names=("state", "data"))

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Start an asynchronous save (returns once the arrays are safely copied off the device)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(train state, loader state); the train state takes the shapes, dtypes and shardings of
        `abstract_state` (a ShapeDtypeStruct tree), so it may be restored onto another mesh."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["data"])

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
