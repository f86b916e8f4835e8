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
        self._bounded: list[tuple[str, float, float]] = []  # (what, bound in s, since): phases with their own timeout

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
    def paused(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """No step timeout inside: restores, compilations and saves have no step time to compare with.
        With timeout_s the phase has its own bound instead (a checkpoint save or restore): past it the
        watchdog fires, naming the phase."""
        with self._lock:
            if timeout_s is None:
                self._paused += 1
            else:
                self._bounded.append((what, timeout_s, time.monotonic()))
        try:
            yield
        finally:
            with self._lock:
                if timeout_s is None:
                    self._paused -= 1
                else:
                    self._bounded.pop()
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
                now = time.monotonic()
                overdue = [(what, bound, now - since) for what, bound, since in self._bounded if now - since > bound]
                if overdue:
                    what, bound, took = overdue[0]
                    report = self._report(took, f"{what} did not finish within its bound of {bound:g} s")
                elif self._paused or self._bounded or now - self._last_at <= self._timeout()[0]:
                    continue
                else:
                    report = self._report(now - self._last_at)
            self.fired = True
            self._fire(report)
            return

    def _report(self, idle: float, headline: str = "") -> str:
        timeout, derivation = self._timeout()
        headline = headline or f"no progress for {idle:.1f} s (timeout {timeout:.4g} s)"
        step = "none yet" if self._last_step is None else (
            f"{self._last_step[0]} ({'untimed' if self._last_step[1] is None else f'{self._last_step[1]:.4g} s'})")
        median = f"{statistics.median(self._times):.4g} s" if self._times else "n/a"
        lines = [f"hang watchdog: {headline}",
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
        print(f"{report.splitlines()[0]}; report in {where}; exiting {EXIT_HANG}", file=sys.stderr)
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


class HostScores:
    """Per-host straggler scores of a multi-process run, from every process's host time per step.

    A step of a synchronous program ends for all when its slowest process has taken part: the time a
    process spends on its host between receiving one step's result and dispatching the next (its data,
    logging, a slow CPU, disk or injected delay) delays the whole fleet, and every other process spends it
    waiting in the step's collectives, where it looks like step time. So each window every process reports
    its median host time per step, and a host's score is the share of the fleet's step it costs:
    (its host time - the median host time of the others) / the median step time. A host above `threshold` in
    `windows` consecutive windows is named with its devices; its ratio to its own best window tells
    whether it got slower or was always slow. Device-side slowness (a degraded GPU) is not in host time:
    every process waits for it alike, so it shows in the step time, not here.
    """

    def __init__(self, threshold: float, windows: int = 2):
        self.threshold, self.windows = threshold, windows
        self._best: dict[int, float] = {}
        self._over: dict[int, int] = {}  # consecutive windows above the threshold, by process

    def observe(self, steps: tuple[int, int], reports: dict[int, dict]) -> tuple[list[dict], float, list[str]]:
        """(every process's score, slowest first; the seconds the fleet waited for its slowest host beyond
        the median of the others over the window; warnings naming persistent stragglers) for the window of steps
        [first, last] and each process's report {host_s, step_s, steps, host, devices}."""
        if len(reports) < 2:
            return [], 0.0, []
        step_s = statistics.median(r["step_s"] for r in reports.values())
        scores, warnings, waited = [], [], 0.0
        for process, r in sorted(reports.items()):
            best = self._best[process] = min(self._best.get(process, math.inf), r["host_s"])
            median_host = statistics.median(o["host_s"] for q, o in reports.items() if q != process)
            waited = max(waited, r["host_s"] - median_host)
            score = (r["host_s"] - median_host) / step_s if step_s > 0 else 0.0
            self._over[process] = self._over.get(process, 0) + 1 if score > self.threshold else 0
            scores.append({"process": process, "host": r["host"], "devices": r["devices"], "score": round(score, 4),
                           "host_s": r["host_s"], "vs_own_best": round(r["host_s"] / best, 3) if best > 0 else 1.0,
                           "straggler": self._over[process] >= self.windows})
            if scores[-1]["straggler"]:
                warnings.append(
                    f"warning: straggler host: process {process} on {r['host']} (devices {ranges(r['devices'])}) "
                    f"costs the fleet {r['host_s'] - median_host:.3g} s of each {step_s:.3g} s step over steps "
                    f"{steps[0]}-{steps[1]} (score {score:.2f} > fault.straggler_host_threshold {self.threshold:g}, "
                    f"{self._over[process]} windows running; {scores[-1]['vs_own_best']:.2f}x its own best)")
        scores.sort(key=lambda x: -x["score"])
        return scores, waited * max(r["steps"] for r in reports.values()), warnings


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7': a host of 8 GPUs, or the absent processes of 16,000, on one line."""
    parts, run = [], []
    for i in [*indices, None]:
        if run and (i is None or i != run[-1] + 1):
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        if i is not None:
            run.append(i)
    return ", ".join(parts)


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
