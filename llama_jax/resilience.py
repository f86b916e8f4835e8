"""Keeping a long run alive and honest: hang watchdog, preemption, stragglers, bad steps.

Everything here is host-side bookkeeping with no JAX dependency, so it can be tested with real
threads and signals in milliseconds. The training loop (llama_jax/train.py) owns the instances;
goodput.py accounts for the time, checkpoint.py decides when to save.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llama_jax.errors import EXIT_HANG

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
# Stragglers and bad steps


class StragglerDetector:
    """Warn about a step far slower than the rolling median. Slow steps enter the window too: a lasting
    slowdown becomes the new normal after about window/2 steps instead of warning on every step."""

    def __init__(self, factor: float = 3.0, window: int = 50, min_steps: int = 10):
        self.factor, self.min_steps = factor, min_steps
        self._times: deque[float] = deque(maxlen=window)

    def observe(self, step: int, seconds: float, process: int = 0) -> str | None:
        warning = None
        if len(self._times) >= self.min_steps:
            median = statistics.median(self._times)
            if seconds > self.factor * median:
                warning = (f"warning: straggler: step {step} took {seconds:.3g} s, {seconds / median:.1f}x "
                           f"the median {median:.3g} s; seen on process {process}")
        self._times.append(seconds)
        return warning


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
