"""A run's failed durable saves. A durable write that fails (no space, a read-only filesystem, an I/O error, no
permission, the directory gone) is known to every process at the agreement that precedes the next save, or at the
end of the run (checkpointer.py), so all handle the same failures alike: the failed step is removed wherever any
trace of it is (it is not a checkpoint), the newest complete step stays, and the run warns in one line (the step,
the reason, the directory and its free space) and goes on, saving again at the next interval: a transient failure
of a shared filesystem must not end a run of thousands of GPUs, and the node-local tier still protects it
meanwhile. After checkpoint.max_failed_saves failures in a row, or when the run's last save fails, it stops with
StorageFailure (exit 74), which the supervisor and the launchers do not restart: the storage needs a person.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from llama_jax.checkpoint.local import LocalTier
from llama_jax.checkpoint.local_files import finished_steps
from llama_jax.config import CheckpointConfig
from llama_jax.distributed.peers import Peers
from llama_jax.errors import EXIT_STORAGE, StorageFailure


class FailedSaves:
    """The durable saves of one run that failed in a row, and what one more does: every process is handed the same
    failures (the Checkpointer's agreements), so every process removes, warns or stops alike."""

    def __init__(
        self,
        directory: Path,
        manager: ocp.CheckpointManager,
        peers: Peers,
        config: CheckpointConfig,
        local: LocalTier | None,
        print_fn: Callable[[str], None],
    ):
        self.directory, self.manager, self.peers = directory, manager, peers
        self.config, self.local, self.print_fn = config, local, print_fn
        self.in_a_row = 0  # durable saves that failed, since the last one written everywhere

    def handle(self, failures: list[dict], last: bool = False) -> None:
        """A durable save failed on some process (every process sees the same list): its step is removed wherever
        any trace of it is, and the run goes on (saving again at the next interval) until
        checkpoint.max_failed_saves saves failed in a row, or stops if it was the run's last; StorageFailure."""
        step = failures[0]["step"]
        self._discard(step)
        self.in_a_row += 1
        more = f" and {len(failures) - 1} more process(es)" if len(failures) > 1 else ""
        failed = (
            f"checkpoint save of step {step} failed on process {failures[0]['process']}{more}: {failures[0]['reason']}"
        )
        newest = max(self.manager.all_steps(), default=0)
        kept = f"the newest complete checkpoint is step {newest}" if newest else "no complete checkpoint exists"
        bound = self.config.max_failed_saves
        if last or self.in_a_row > bound:
            why = (
                "the run's last save"
                if last
                else (f"{self.in_a_row} saves failed in a row (checkpoint.max_failed_saves={bound})")
            )
            raise StorageFailure(
                f"{failed}; {why}: stopping (exit {EXIT_STORAGE}); {kept}{self._newer_local(newest)}; "
                "free space or fix the filesystem, then re-run the same command"
            )
        self.print_fn(
            f"warning: {failed}; {kept}; training goes on and saves again at the next interval "
            f"({self.in_a_row} of checkpoint.max_failed_saves={bound} failed saves in a row)"
        )

    def _newer_local(self, durable: int) -> str:
        """Where the local tier holds a newer step than checkpoints/: what a restart resumes from."""
        local = max(finished_steps(self.local.directory), default=0) if self.local is not None else 0
        return (
            f"; the local tier holds step {local}, which a restart on the same hosts resumes from"
            if local > durable
            else ""
        )

    def _discard(self, step: int) -> None:
        """Remove every trace of a step some process failed to write: Orbax's temporary directories, and the step
        itself where it was finalised (a process's shards of it are missing). Process 0 removes, all wait."""
        if self.peers.index == 0:
            for partial in [*self.directory.glob(f"{step}.orbax-checkpoint-tmp*"), self.directory / str(step)]:
                shutil.rmtree(partial, ignore_errors=True)
        self.peers.barrier(f"failed step {step} removed")
        self.manager.reload()
