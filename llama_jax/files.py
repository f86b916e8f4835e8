"""Small helpers every layer shares: atomic writes, the user cache directory, and sizes, times and id ranges
as the commands print them."""

from __future__ import annotations

import os
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
