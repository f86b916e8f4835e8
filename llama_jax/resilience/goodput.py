"""Goodput: the share of wall time spent on productive steps, across every restart of a run.

Kept in <run_dir>/goodput.json, one record per attempt (process start), written atomically by
process 0. The rest of the wall time is broken down into compilation, checkpoint save and restore,
data wait, evaluation, lost work (steps computed again after a failure or a rollback), straggler time
(in a multi-process run: the fleet waiting for its slowest host beyond the others' median, stragglers.HostScores)
and restart overhead. The training loop reports each step and each pause to one Goodput, whose step clock also
gives the step times the throughput meter and the hang watchdog use.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llama_jax.files import atomic_path, format_seconds

BUCKETS = (
    "productive",
    "compile",
    "checkpoint_save",
    "checkpoint_restore",
    "data_wait",
    "eval",
    "lost",
    "straggler",
    "restart",
    "other",
)


# A start (the first, or a restart), part by part, in the order a process goes through them; kept with each attempt
# in goodput.json ("start") and shown by `llama-jax goodput --from`. "launch" (the process's start by the OS to the
# command's) lies before the attempt's started_at, inside the gap after a failure; "compile" is Run.setup's (the
# step's ahead-of-time compile, or its load from the persistent cache); "loop_setup" the loop's own parts (the
# checkpointer, the metrics log, the peak FLOP/s); "first_step" the first step's own time.
START_PARTS = (
    "launch",
    "imports",
    "distributed_init",
    "data",
    "preflight",
    "compile",
    "loop_setup",
    "restore",
    "first_step",
)


class StartClock:
    """The parts of this process's start, each the wall time since the previous mark (START_PARTS names them).
    `launched`: the process was started for this run (the command line), so its launch is part of the start; a
    run called from a longer-lived process (the Python API, a notebook) has none."""

    def __init__(self, started_at: float, launched: bool = False, now: Callable[[], float] = time.time):
        self.started_at, self.now, self._last = started_at, now, started_at
        self.parts: dict[str, float] = {}
        process_start = process_started_at() if launched else None
        if process_start is not None:
            self.parts["launch"] = max(0.0, started_at - process_start)

    def mark(self, part: str) -> None:
        """`part` ends now (it began at the previous mark)."""
        if part not in START_PARTS:
            raise ValueError(f"unknown start part {part!r}; one of {', '.join(START_PARTS)}")
        now = self.now()
        self.parts[part] = self.parts.get(part, 0.0) + max(0.0, now - self._last)
        self._last = now


def process_started_at() -> float | None:
    """When the OS started this process (wall clock, 10 ms resolution): its start in clock ticks since boot
    (/proc/self/stat, field 22) against the time since boot now. None where there is no /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # the fields after the name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME here
        return None
    return time.time() - age


class Goodput:
    """Effective training time across restarts, kept in <run_dir>/goodput.json (written atomically by process 0).

    One record per attempt (process start). `lost` is time first counted as productive and then thrown
    away (steps recomputed after a restart or a rollback), so the productive total is the sum of
    productive minus lost; `redone_steps` counts the steps a restart recomputed. A killed attempt never
    writes a last record: what it did after its last flush() falls into the gap between its last_alive
    and the next start, charged to `restart`.
    An attempt ended with finish() (the run reached its step target) is followed by idle time of the
    user's choosing: that gap is neither charged nor part of the wall time.
    """

    def __init__(
        self,
        run_dir: Path,
        started_at: float,
        write: bool = True,
        now: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
        print_fn: Callable[[str], None] = print,
    ):
        # now: wall time (attempts are compared across processes); clock: the monotonic step clock.
        self.path, self.write, self.now, self.clock = Path(run_dir) / "goodput.json", write, now, clock
        self.print_fn, self.unwritable = print_fn, False  # a failed write warns once: bookkeeping never stops a run
        self.previous = _read_attempts(self.path)
        self.current: dict[str, Any] = {
            "started_at": started_at,
            "pid": os.getpid(),
            "resumed_step": None,
            "last_alive": started_at,
            "outcome": "died",
            "highest_step": 0,
            "timed_steps": 0,
            "step_seconds": 0.0,
            "buckets": dict.fromkeys(BUCKETS, 0.0),
        }
        self._step_start, self._paused, self._pauses = clock(), 0.0, 0  # see time_step

    def begin(self, resumed_step: int) -> None:
        """The loop starts at resumed_step: charge the previous attempt's lost steps and the restart."""
        now, current = self.now(), self.current
        current.update(resumed_step=resumed_step, highest_step=resumed_step)
        before = sum(current["buckets"].values())  # e.g. checkpoint_restore, already charged
        self.add("restart", now - current["started_at"] - before)
        if self.previous:
            last = self.previous[-1]
            # Only the newest attempt: steps an older one computed beyond this point were charged by its successor.
            redone = last["highest_step"] - resumed_step
            current["redone_steps"] = max(0, redone)
            if redone > 0 and last["timed_steps"]:
                self.add("lost", redone * last["step_seconds"] / last["timed_steps"])
            if last["outcome"] != "finished":
                self.add("restart", current["started_at"] - last["last_alive"])
        self.flush()
        self._step_start, self._paused = self.clock(), 0.0

    def start_parts(self, parts: dict[str, float]) -> None:
        """Where this attempt's start went (StartClock.parts), kept with it; begin() flushes it."""
        self.current["start"] = dict(parts)

    def add(self, bucket: str, seconds: float) -> None:
        if bucket not in BUCKETS:
            raise ValueError(f"unknown goodput bucket {bucket!r}; one of {', '.join(BUCKETS)}")
        self.current["buckets"][bucket] += max(0.0, seconds)  # clocks can step backwards

    def step_done(self, step: int, seconds: float) -> None:
        self.add("productive", seconds)
        self.current["timed_steps"] += 1
        self.current["step_seconds"] += seconds
        self.current["highest_step"] = max(self.current["highest_step"], step)

    def discard(self, back_to: int, from_step: int) -> None:
        """A rollback from from_step to back_to: those steps' time becomes lost (at this attempt's mean)."""
        current = self.current
        if current["timed_steps"] and from_step > back_to:
            self.add("lost", (from_step - back_to) * current["step_seconds"] / current["timed_steps"])
        current["highest_step"] = back_to

    def stragglers(self, waited_s: float, scores: list[dict]) -> None:
        """A window of a multi-process run: the fleet waited waited_s for its slowest host beyond the
        others' median. That time was counted as productive step time; it is the straggler's. The scores of
        the newest window are kept with the attempt."""
        moved = min(waited_s, self.current["buckets"]["productive"])
        self.current["buckets"]["productive"] -= moved
        self.add("straggler", moved)
        self.current["hosts"] = scores

    def tier(self, kind: str, seconds: float, nbytes: int = 0, count: int = 1) -> None:
        """Checkpoint cost by tier, kept with the attempt beside the buckets (process 0's view): save_local
        and save_durable (seconds the loop was blocked), write_local (the background writes' seconds and the
        bytes this host wrote), restore_local and restore_durable (seconds spent restoring, or trying to)."""
        entry = self.current.setdefault("tiers", {}).setdefault(kind, {"count": 0, "seconds": 0.0, "bytes": 0})
        entry["count"] += count
        entry["seconds"] += max(0.0, seconds)
        entry["bytes"] += nbytes

    def restored(self, tier: str, copies: str = "") -> None:
        """Which tier served this attempt's restore ("local" or "durable"), and whose copies (local tier)."""
        self.current["restored_from"] = f"{tier} ({copies})" if copies else tier

    def flush(self) -> None:
        """Persist; also the attempt's sign of life (last_alive) should it be killed without a word."""
        self.current["last_alive"] = self.now()
        if not self.write:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.path) as tmp:
                with open(tmp, "w") as f:
                    json.dump({"attempts": [*self.previous, self.current]}, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as err:
            if not self.unwritable:
                self.unwritable = True
                self.print_fn(
                    f"warning: writing {self.path} failed ({err.strerror or err}); training goes on without it"
                )

    def finish(self, preempted: bool = False) -> None:
        """The loop ended on its own terms: finished its steps, or saved and stopped on a signal."""
        self.current["outcome"] = "preempted" if preempted else "finished"
        self.flush()

    def summary(self) -> dict[str, Any]:
        return summarize([*self.previous, self.current], self.now())

    # The step clock: how long each step took, without the pauses between steps.

    @contextmanager
    def pause(self, bucket: str | None) -> Iterator[None]:
        """Time inside is charged to `bucket` (None: to none) and is not part of the next step's time:
        evaluation, checkpoint saves, rollbacks. Pauses may nest; the outermost one stops the clock."""
        start = self.clock()
        self._pauses += 1
        try:
            yield
        finally:
            seconds = self.clock() - start
            self._pauses -= 1
            if bucket is not None:
                self.add(bucket, seconds)
            if not self._pauses:
                self._paused += seconds

    def time_step(self, step: int, data_wait: float, compiled: bool = False) -> float:
        """A step finished: its seconds since the previous one (data wait included, pauses not), charged to
        data_wait and to compile (the step that compiled) or productive."""
        now = self.clock()
        seconds = now - self._step_start - self._paused
        self._step_start, self._paused = now, 0.0
        self.add("data_wait", data_wait)
        if compiled:
            self.add("compile", seconds - data_wait)
            # The process's first step; a later stage's first step (its own program) is compile time, not start-up.
            self.current.setdefault("start", {}).setdefault("first_step", seconds - data_wait)
        else:
            self.step_done(step, seconds - data_wait)
        return seconds


def summarize(attempts: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Goodput and the time of each bucket over all attempts, from the first start until `now`."""
    totals = {b: sum(a["buckets"].get(b, 0.0) for a in attempts) for b in BUCKETS}
    totals["productive"] -= totals["lost"]
    wall = now - attempts[0]["started_at"] - _idle_s(attempts)
    totals["other"] += max(0.0, wall - sum(totals.values()))  # the unaccounted rest (logging, loop overhead)
    tiers: dict[str, dict[str, float]] = {}
    for attempt in attempts:
        for kind, entry in attempt.get("tiers", {}).items():
            total = tiers.setdefault(kind, {"count": 0, "seconds": 0.0, "bytes": 0})
            for field in total:
                total[field] += entry.get(field, 0)
    return {
        "goodput": totals["productive"] / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "attempts": len(attempts),
        **totals,
        "tiers": tiers,
        "redone_steps": sum(a.get("redone_steps", 0) for a in attempts),
        "restores": dict(Counter(a["restored_from"] for a in attempts if a.get("restored_from"))),
    }


def format_goodput(s: dict[str, Any]) -> str:
    parts = ", ".join(f"{b} {format_seconds(s[b])}" for b in BUCKETS if s[b] >= 0.05)
    n = s["attempts"]
    return (
        f"goodput {100 * s['goodput']:.1f}% of {format_seconds(s['wall_s'])} over {n} attempt{'s' * (n != 1)}: {parts}"
    )


def read_goodput(run_dir: Path) -> dict[str, Any] | None:
    """The goodput of a run so far, from its goodput.json (until its last sign of life); None without one."""
    attempts = _read_attempts(Path(run_dir) / "goodput.json")
    return summarize(attempts, max(a["last_alive"] for a in attempts)) if attempts else None


def _read_attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts recorded so far; none when the file is missing or unreadable (bookkeeping must not stop a run)."""
    try:
        attempts = json.loads(path.read_text())["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [a for a in attempts if isinstance(a, dict) and {"started_at", "last_alive", "buckets"} <= a.keys()]


def _idle_s(attempts: list[dict[str, Any]]) -> float:
    """Time between a finished attempt and the next one: chosen by the user, not lost to a failure."""
    return sum(
        max(0.0, b["started_at"] - a["last_alive"])
        for a, b in zip(attempts, attempts[1:])
        if a.get("outcome") == "finished"
    )


def observed_mtbf_s(run_dir: Path) -> float | None:
    """Wall time / attempts that ended without a clean finish (killed, crashed, hung or preempted); call
    it before Goodput.begin writes this attempt. None if nothing failed yet."""
    attempts = _read_attempts(Path(run_dir) / "goodput.json")
    failures = sum(a.get("outcome") != "finished" for a in attempts)
    if not failures:
        return None
    wall = max(a["last_alive"] for a in attempts) - attempts[0]["started_at"] - _idle_s(attempts)
    return wall / failures if wall > 0 else None


def read_attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts a goodput.json holds (what `llama-jax goodput --from` measures its costs from)."""
    return _read_attempts(Path(path))
