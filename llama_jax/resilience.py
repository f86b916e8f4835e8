"""Keeping a long run alive and honest: hang watchdog, preemption, goodput, stragglers, bad steps.

Everything here is host-side bookkeeping with no JAX dependency, so it can be tested with real
threads and signals in milliseconds. The training loop (llama_jax/train.py) owns the instances.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llama_jax.files import atomic_path
from llama_jax.supervise import EXIT_HANG, EXIT_PREEMPTED  # the supervisor's contract: restart on these

__all__ = ["EXIT_HANG", "EXIT_PREEMPTED", "Goodput", "HangWatchdog", "PreemptionGuard", "SpikeGuard",
           "StragglerDetector", "auto_checkpoint_steps", "format_goodput", "interval_advice", "observed_mtbf_s",
           "read_goodput",
           "summarize", "young_daly_interval_s"]

DESCRIBE_TIMEOUT_S = 120.0  # describe() may itself block (it may compile); the dump must still finish


def _write_durably(path: Path, text: str) -> None:
    """Write, flush and fsync in place: a dump must reach the disk before the process is killed."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Hang watchdog


class HangWatchdog:
    """Our flight recorder. A daemon thread; if no progress is reported within the timeout, write
    <run_dir>/hang-<host>.txt and exit the process with EXIT_HANG (os._exit: the main thread is stuck,
    typically in a collective that waits for a dead peer, so no exception could ever reach it)."""

    def __init__(self, run_dir: Path, host: str, *, factor: float = 10.0, min_timeout_s: float = 300.0,
                 startup_timeout_s: float = 3600.0, window: int = 50, describe: Callable[[], str] = lambda: "",
                 exit_fn: Callable[[int], None] = os._exit, poll_s: float = 1.0):
        self.path = Path(run_dir) / f"hang-{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}.txt"
        self.host, self.factor, self.min_timeout_s = host, factor, min_timeout_s
        self.startup_timeout_s, self.describe, self.exit_fn, self.poll_s = startup_timeout_s, describe, exit_fn, poll_s
        self.fired = False
        self._times: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_at = time.monotonic()
        self._last_what = "watchdog started"
        self._last_step: tuple[int, float | None] | None = None
        self._paused = 0

    def __enter__(self) -> HangWatchdog:
        self.progress("watchdog started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.poll_s + 1)
        self._thread = None

    def step_done(self, step: int, seconds: float | None) -> None:
        """A completed step; seconds=None for one whose time must not set the timeout (compilation)."""
        with self._lock:
            if seconds is not None:
                self._times.append(seconds)
            self._last_step = (step, seconds)
            self._last_at, self._last_what = time.monotonic(), f"step {step} done"

    def progress(self, what: str) -> None:
        with self._lock:
            self._last_at, self._last_what = time.monotonic(), what

    @contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """No timeout inside: restores, compilations and final saves have no step time to compare with."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last_at, self._last_what = time.monotonic(), f"{what} finished"

    @property
    def timeout_s(self) -> float:
        with self._lock:
            return self._timeout()[0]

    def _timeout(self) -> tuple[float, str]:
        """(timeout, how it was derived); call with the lock held."""
        if not self._times:
            return self.startup_timeout_s, f"startup timeout {self.startup_timeout_s:g} s (no timed step yet)"
        median = statistics.median(self._times)
        timeout = max(self.min_timeout_s, self.factor * median)
        return timeout, (f"max(min {self.min_timeout_s:g} s, {self.factor:g} x median step time {median:.4g} s "
                         f"of the last {len(self._times)} steps) = {timeout:.4g} s")

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                idle = time.monotonic() - self._last_at
                if self._paused or idle <= self._timeout()[0]:
                    continue
                report = self._report(idle)
            self.fired = True
            self._fire(report)
            return

    def _report(self, idle: float) -> str:
        timeout, derivation = self._timeout()
        step = "none yet" if self._last_step is None else (
            f"{self._last_step[0]} ({'untimed' if self._last_step[1] is None else f'{self._last_step[1]:.4g} s'})")
        median = f"{statistics.median(self._times):.4g} s" if self._times else "n/a"
        lines = [f"hang watchdog: no progress for {idle:.1f} s (timeout {timeout:.4g} s)",
                 f"time (UTC): {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
                 f"host: {self.host}", f"pid: {os.getpid()}", f"timeout: {derivation}",
                 f"last completed step: {step}; recent median step time {median}",
                 f"last progress: {self._last_what}, {idle:.1f} s ago", "", "Python stacks of every thread:"]
        return "\n".join(lines) + "\n" + _all_stacks()

    def _fire(self, report: str) -> None:
        # Stacks first and durably: describe() may block or crash, and the stacks matter most.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_durably(self.path, report)
            described = _call_with_timeout(self.describe, DESCRIBE_TIMEOUT_S) or "(describe() returned nothing)"
            report += "\nWhat the compiled step communicates:\n" + described
            _write_durably(self.path, report + "\n")
            where = str(self.path)
        except OSError as e:  # a full or gone disk must not stop the exit: a stuck job wastes the cluster
            where = f"nowhere ({e}); stacks follow on stderr\n{report}"
        print(f"hang watchdog: no progress within the timeout; report in {where}; exiting {EXIT_HANG}",
              file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # os._exit skips this, and the last log lines are the useful ones
            except (OSError, ValueError):
                pass
        self.exit_fn(EXIT_HANG)


def _all_stacks() -> str:
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        name, daemon = names.get(ident, ("<unknown>", False))
        parts.append(f"\nThread {name!r} (id {ident}{', daemon' if daemon else ''}), most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "".join(parts)


def _call_with_timeout(fn: Callable[[], str], timeout_s: float) -> str:
    result: list[str] = []

    def run() -> None:
        try:
            result.append(str(fn()))
        except Exception as e:  # noqa: BLE001 - any failure becomes a note in the dump
            result.append(f"(describe() failed: {type(e).__name__}: {e})")

    thread = threading.Thread(target=run, name="hang-describe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else f"(describe() did not return within {timeout_s:g} s)"


# ---------------------------------------------------------------------------------------------
# Preemption


class PreemptionGuard:
    """SIGTERM/SIGINT -> a flag the loop polls once per step, so it can save the current step and exit.

    Multi-process runs (sync given, e.g. Orbax's CheckpointManager.reached_preemption): JAX's
    preemption notifier owns SIGTERM, and only sync(step) decides, because it is the point all
    processes agree on; a process that stopped on its own flag would leave the others waiting in a
    collective. So there SIGINT is turned into a SIGTERM to ourselves and the local flag only names it.
    """

    def __init__(self, sync: Callable[[int], bool] | None = None):
        self.sync = sync
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python only delivers signals to the main thread; sync still works
        ours = [signal.SIGINT] if self.sync is not None else [signal.SIGTERM, signal.SIGINT]
        for sig in ours:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            # None: the previous handler was installed from C and cannot be put back; default then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the user insists: stop now, without the save
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        if self.sync is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        if self.sync is not None:
            return bool(self.sync(step))
        return self.signal_name is not None


# ---------------------------------------------------------------------------------------------
# Goodput


BUCKETS = ("productive", "compile", "checkpoint_save", "checkpoint_restore", "data_wait", "eval", "lost",
           "restart", "other")


class Goodput:
    """Effective training time across restarts, kept in <run_dir>/goodput.json (written atomically by process 0).

    One record per attempt (process start). `lost` is time first counted as productive and then thrown
    away (steps recomputed after a restart or a rollback), so the productive total is the sum of
    productive minus lost. A killed attempt never writes a last record: what it did after its last
    flush() falls into the gap between its last_alive and the next start, charged to `restart`.
    An attempt ended with finish() (the run reached its step target) is followed by idle time of the
    user's choosing: that gap is neither charged nor part of the wall time.
    """

    def __init__(self, run_dir: Path, started_at: float, write: bool = True, now: Callable[[], float] = time.time):
        self.path, self.write, self.now = Path(run_dir) / "goodput.json", write, now
        self.previous = _read_attempts(self.path)
        self.current: dict[str, Any] = {
            "started_at": started_at, "pid": os.getpid(), "resumed_step": None, "last_alive": started_at,
            "outcome": "died", "highest_step": 0, "timed_steps": 0, "step_seconds": 0.0,
            "buckets": dict.fromkeys(BUCKETS, 0.0)}

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
            if redone > 0 and last["timed_steps"]:
                self.add("lost", redone * last["step_seconds"] / last["timed_steps"])
            if last["outcome"] != "finished":
                self.add("restart", current["started_at"] - last["last_alive"])
        self.flush()

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

    def flush(self) -> None:
        """Persist; also the attempt's sign of life (last_alive) should it be killed without a word."""
        self.current["last_alive"] = self.now()
        if self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.path) as tmp:
                with open(tmp, "w") as f:
                    json.dump({"attempts": [*self.previous, self.current]}, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())

    def finish(self, preempted: bool = False) -> None:
        """The loop ended on its own terms: finished its steps, or saved and stopped on a signal."""
        self.current["outcome"] = "preempted" if preempted else "finished"
        self.flush()

    def summary(self) -> dict[str, Any]:
        return summarize([*self.previous, self.current], self.now())

    def format(self) -> str:
        return format_goodput(self.summary())


def summarize(attempts: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Goodput and the time of each bucket over all attempts, from the first start until `now`."""
    totals = {b: sum(a["buckets"].get(b, 0.0) for a in attempts) for b in BUCKETS}
    totals["productive"] -= totals["lost"]
    wall = now - attempts[0]["started_at"] - _idle_s(attempts)
    totals["other"] += max(0.0, wall - sum(totals.values()))  # the unaccounted rest (logging, loop overhead)
    return {"goodput": totals["productive"] / wall if wall > 0 else 0.0, "wall_s": wall,
            "attempts": len(attempts), **totals}


def format_goodput(s: dict[str, Any]) -> str:
    parts = ", ".join(f"{b} {_duration(s[b])}" for b in BUCKETS if s[b] >= 0.05)
    n = s["attempts"]
    return f"goodput {100 * s['goodput']:.1f}% of {_duration(s['wall_s'])} over {n} attempt{'s' * (n != 1)}: {parts}"


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
    return sum(max(0.0, b["started_at"] - a["last_alive"])
               for a, b in zip(attempts, attempts[1:]) if a.get("outcome") == "finished")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def observed_mtbf_s(run_dir: Path) -> float | None:
    """Wall time / attempts that ended without a clean finish (killed, crashed, hung or preempted); call
    it before Goodput.begin writes this attempt. None if nothing failed yet."""
    attempts = _read_attempts(Path(run_dir) / "goodput.json")
    failures = sum(a.get("outcome") != "finished" for a in attempts)
    if not failures:
        return None
    wall = max(a["last_alive"] for a in attempts) - attempts[0]["started_at"] - _idle_s(attempts)
    return wall / failures if wall > 0 else None


# ---------------------------------------------------------------------------------------------
# Checkpoint interval


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum of the checkpoint interval: sqrt(2 × save cost × MTBF)."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_s >= 0 and mtbf_s > 0, got {save_s} and {mtbf_s}")
    return math.sqrt(2 * save_s * mtbf_s)


def auto_checkpoint_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / step_s))


def interval_advice(save_s: float, mtbf_s: float, step_s: float, every_steps: int, auto: bool = False) -> str:
    """The log line: the Young/Daly interval for the measured save time next to the one in use."""
    derivation = f"sqrt(2 x save {save_s:.2f}s x MTBF {mtbf_s / 3600:.2g} h) = {young_daly_interval_s(save_s, mtbf_s):.0f}s"
    steps = auto_checkpoint_steps(save_s, mtbf_s, step_s)
    if auto:
        return f"checkpoint.every_steps=auto: {derivation} at {step_s:.3f}s a step -> saving every {steps} steps"
    return (f"checkpoint interval advice (Young/Daly): {derivation} = {steps} steps; "
            f"checkpoint.every_steps is {every_steps or 'only at the end'}")


# ---------------------------------------------------------------------------------------------
# Stragglers and bad steps


class StragglerDetector:
    """Warn about a step far slower than the rolling median. Slow steps enter the window too: a lasting
    slowdown becomes the new normal after about window/2 steps instead of warning on every step."""

    def __init__(self, factor: float = 3.0, window: int = 50, min_steps: int = 10):
        self.factor, self.min_steps = factor, min_steps
        self._times: deque[float] = deque(maxlen=window)

    def observe(self, step: int, seconds: float, per_process: Sequence[float] | None = None,
                process: int = 0) -> str | None:
        warning = None
        if len(self._times) >= self.min_steps:
            median = statistics.median(self._times)
            if seconds > self.factor * median:
                warning = (f"warning: straggler: step {step} took {seconds:.3g} s, {seconds / median:.1f}x "
                           f"the median {median:.3g} s; {self._who(process, per_process)}")
        self._times.append(seconds)
        return warning

    @staticmethod
    def _who(process: int, per_process: Sequence[float] | None) -> str:
        if not per_process:
            return f"seen on process {process}"
        slowest = max(range(len(per_process)), key=per_process.__getitem__)
        others = [t for i, t in enumerate(per_process) if i != slowest]
        if not others:
            return f"slowest process {slowest} (busy {per_process[slowest]:.3g} s)"
        median = statistics.median(others)
        ratio = f"{per_process[slowest] / median:.1f}x" if median > 0 else "inf x"
        return (f"slowest process {slowest} (busy {per_process[slowest]:.3g} s, {ratio} the median "
                f"{median:.3g} s of the other {len(others)})")


SPIKE_MIN_HISTORY = 10  # good losses needed before a standard deviation means anything


class SpikeGuard:
    """Host-side bookkeeping for bad steps. The jitted step already skips updates with a non-finite loss
    or grad norm; here: count them, apply the loss-spike rule, decide when to roll back.
    A spike's update was applied (it is only seen afterwards); max_bad_steps 0 never rolls back."""

    def __init__(self, max_bad_steps: int = 3, zscore: float = 0.0, window: int = 100):
        self.max_bad_steps, self.zscore = max_bad_steps, zscore
        self._losses: deque[float] = deque(maxlen=window)
        self.bad_steps_total = 0
        self.consecutive = 0

    def observe(self, step: int, loss: float, finite: bool) -> str:
        """"ok", "skipped" (non-finite), "spike" or "rollback" (max_bad_steps bad steps in a row)."""
        if not finite or not math.isfinite(loss):
            verdict = "skipped"
        elif self._is_spike(loss):
            verdict = "spike"  # kept out of the window, so a run of spikes cannot raise the bar
        else:
            self._losses.append(loss)
            self.consecutive = 0
            return "ok"
        self.bad_steps_total += 1
        self.consecutive += 1
        return "rollback" if 0 < self.max_bad_steps <= self.consecutive else verdict

    def _is_spike(self, loss: float) -> bool:
        if self.zscore <= 0 or len(self._losses) < min(SPIKE_MIN_HISTORY, self._losses.maxlen or 0):
            return False
        return loss > statistics.fmean(self._losses) + self.zscore * statistics.pstdev(self._losses)

    def reset(self) -> None:
        """After a rollback: the bad run is over (the losses of good steps stay, they were good)."""
        self.consecutive = 0
