"""Small helpers every layer shares: atomic writes, the user cache directory, what a failed write means, whether
a path a command reads can be read and one it writes can be written (one reason, for its one-line error), and
sizes, times and id ranges as the commands print them."""

from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds it replaces `path` in one rename.

    The temporary name carries the process id, so concurrent writers never share one; on an error
    it is removed and `path` is left as it was.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def storage_errno(err: BaseException) -> int | None:
    """The errno of a failed write: an OSError's, or the os_error_code a library's message carries (TensorStore's,
    under Orbax: 'Failed to write ... No space left on device [os_error_code='28']')."""
    if isinstance(err, OSError) and err.errno:
        return err.errno
    code = re.search(r"os_error_code='?(\d+)", str(err))
    return int(code.group(1)) if code else None


# What a person must fix when a write fails with one of these; other errors are not storage's.
STORAGE_ERRNOS = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EIO,
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
    errno.ENOTDIR,
)


def describe_write_failure(err: BaseException, where: Path) -> str:
    """'No space left on device (ENOSPC) in /runs/a/checkpoints, 0 B free there': why a write into `where` failed."""
    code = storage_errno(err)
    reason = (
        f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        if code
        else (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    )
    return f"{reason} in {where}, {free_space(where)} free there"


def nearest_existing(path: Path) -> Path:
    """`path` (absolute) if it exists, else its nearest ancestor that does: where a directory would be made.
    (os.path.exists: a path below a directory this user may not search counts as absent, not as an error.)"""
    existing = Path(path).absolute()
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(path: Path) -> int | None:
    """The free bytes of the filesystem holding `path` (its nearest existing directory); None if unknown."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def free_space(path: Path) -> str:
    """The free space of the filesystem holding `path`, as the commands print it."""
    free = free_bytes(path)
    return "unknown space" if free is None else format_bytes(free)


def unwritable(path: Path, kind: str = "directory") -> str | None:
    """Why a `kind` ("directory" or "file") cannot be created or written at `path`, or None when it can: the other
    kind in its place, a file on the way there, or the place it goes on a read-only filesystem or without write
    permission."""
    target = Path(path).expanduser().absolute()
    if os.path.exists(target) and os.path.isdir(target) != (kind == "directory"):
        return f"{target} is a {'file' if kind == 'directory' else 'directory'}, not a {kind}"
    # A file that exists is written in place; anything else is made in its nearest existing directory.
    existing = target if kind == "file" and os.path.exists(target) else nearest_existing(target)
    if existing != target and not existing.is_dir():
        return f"{existing} is a file, where {target} needs a directory"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | (os.X_OK if existing.is_dir() else 0)):
        return f"{existing} is not writable by this user (permission denied)"
    return None


def unreadable(path: Path, kind: str = "directory") -> str | None:
    """Why `path` cannot be read as a `kind` ("directory" or "file"), or None when it can: it does not exist, it is
    the other kind, or this user may not read it (nor, for a directory, list it). The twin of `unwritable`: every
    command checks the paths it reads with it before it reads or writes anything."""
    target = Path(path).expanduser()
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"{target} does not exist"
    except OSError as err:  # e.g. a parent directory this user may not search
        return f"{target} cannot be reached ({err.strerror or type(err).__name__})"
    if stat.S_ISDIR(mode) != (kind == "directory"):
        return f"{target} is a {'directory' if stat.S_ISDIR(mode) else 'file'}, not a {kind}"
    if not os.access(target, os.R_OK | (os.X_OK if kind == "directory" else 0)):
        return f"{target} is not readable by this user (permission denied)"
    return None


def cache_root(cache_dir: str = "") -> Path:
    """Where prepared token stores, compiled steps, tune results and measured peaks are kept:
    `cache_dir` (data.cache_dir) or $XDG_CACHE_HOME/llama_jax or ~/.cache/llama_jax."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama_jax"


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; the unit every command prints sizes in."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_clock(seconds: float) -> str:
    """A time span as a clock shows it, for an ETA: 4000 -> '1h06m', 185 -> '3m05s', 12.3 -> '12s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_seconds(seconds: float) -> str:
    """An amount of time in one unit, for totals that are added up (goodput): '1.1 h', '185 s', '1.2 s'."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def format_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7': a host of 8 GPUs, or the absent processes of 16,000, on one line."""
    parts, run = [], []
    for i in [*indices, None]:
        if run and (i is None or i != run[-1] + 1):
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        if i is not None:
            run.append(i)
    return ", ".join(parts)


def advise(mapped, advice: str) -> None:
    """Tell the kernel how a memory-mapped array (np.memmap, np.load(mmap_mode=...)) is used: "random" (no
    read-ahead around a page fault: a loader reads a few pages here and there, and read-ahead would map
    megabytes into the process for each), or "done" (drop its pages from this process's resident set; they stay
    in the page cache). A no-op for arrays held in memory or where the platform has no madvise."""
    handle = getattr(mapped, "_mmap", None)
    flag = getattr(mmap, {"random": "MADV_RANDOM", "done": "MADV_DONTNEED"}[advice], None)
    if handle is not None and flag is not None and hasattr(handle, "madvise"):
        handle.madvise(flag)
