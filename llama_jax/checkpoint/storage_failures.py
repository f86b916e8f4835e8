"""Storage failures of checkpoint writes (a full disk, a quota, a read-only filesystem, an I/O error, no permission,
a directory gone: files.py's STORAGE_ERRNOS): which errors are the storage's, the one-line record of a failed
write, the check that a save fits before it starts, and Orbax's log records of such failures, dropped because the
Checkpointer (checkpointer.py) reports each in one line. A failure that is not the storage's is a bug: raised.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import jax

from llama_jax.files import STORAGE_ERRNOS, describe_write_failure, free_bytes, storage_errno


def is_storage_failure(err: BaseException | None) -> bool:
    while err is not None:
        if storage_errno(err) in STORAGE_ERRNOS:
            return True
        err = err.__cause__ or err.__context__
    return False


class _ReportedHere(logging.Filter):
    """Orbax logs one failed write from each of its threads, with a traceback (some 30 lines for one full disk);
    the Checkpointer reports it in one line (which step, why, where, the free space), so those records go."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            is_storage_failure(record.exc_info[1] if record.exc_info else None)
            or "os_error_code=" in record.getMessage()
        )


def quiet_storage_noise() -> None:
    """Drop Orbax's records of the storage failures this module reports itself; everything else passes through.
    (A write that fails midway can still leave TensorStore's 'Event loop is closed' tracebacks, printed from its
    own threads: check_room keeps the common case, a full disk, from starting such a write.)"""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _ReportedHere) for f in absl.filters):
        absl.addFilter(_ReportedHere())


def check_room(state: Any, directory: Path) -> None:
    """A save that cannot fit is not started: this process's share of the state (each array's shards whose
    first replica it holds) against the free space, so a full disk fails before Orbax writes a partial step
    (and before its threads report the failure many times over)."""
    share = sum(
        shard.data.nbytes
        for leaf in jax.tree_util.tree_leaves(state)
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
        if shard.replica_id == 0
    )
    free = free_bytes(directory)
    if free is not None and share > free:
        raise OSError(errno.ENOSPC, f"a checkpoint share of {share} bytes does not fit")


def failure_record(step: int | None, process: int, err: BaseException, directory: Path) -> dict:
    """{step, process, reason} of a durable write into `directory` that failed with a storage error; any other
    error is raised as it is."""
    if storage_errno(err) not in STORAGE_ERRNOS:
        raise err
    return {"step": step, "process": process, "reason": describe_write_failure(err, directory)}
