"""The hang watchdog: a step, save or restore that makes no progress for too long ends the process with a
report of where every thread was, so the supervisor restarts it instead of the cluster idling in a
collective that waits for a dead peer.

Host-side bookkeeping with no JAX dependency, tested with real threads in milliseconds.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from llama_jax.errors import EXIT_HANG
from llama_jax.resilience.flight import FlightRecorder

DESCRIBE_TIMEOUT_S = 120.0  # describe() may itself block (it may compile); the dump must still finish


def _write_durably(path: Path, text: str) -> None:
    """Write, flush and fsync in place: a dump must reach the disk before the process is killed."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class HangWatchdog:
    """Our flight recorder. A daemon thread; if no progress is reported within the timeout, write
    <run_dir>/hang-<host>.txt and exit the process with EXIT_HANG (os._exit: the main thread is stuck,
    typically in a collective that waits for a dead peer, so no exception could ever reach it)."""

    def __init__(
        self,
        run_dir: Path,
        host: str,
        *,
        factor: float = 10.0,
        min_timeout_s: float = 300.0,
        startup_timeout_s: float = 3600.0,
        window: int = 50,
        describe: Callable[[], str] = lambda: "",
        exit_fn: Callable[[int], None] = os._exit,
        poll_s: float = 1.0,
        recorder: FlightRecorder | None = None,
    ):
        self.path = Path(run_dir) / f"hang-{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}.txt"
        self.host, self.factor, self.min_timeout_s = host, factor, min_timeout_s
        self.startup_timeout_s, self.describe, self.exit_fn, self.poll_s = startup_timeout_s, describe, exit_fn, poll_s
        self.fired = False
        self.recorder = recorder  # the flight recorder (flight.py): every phase goes in, and a hang its report
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
        self._record("step", f"step {step} done", step)

    def progress(self, what: str) -> None:
        with self._lock:
            self._last_at, self._last_what = time.monotonic(), what
        self._record("progress", what)

    def _record(self, kind: str, what: str, step: int | None = None) -> None:
        if self.recorder is not None:
            self.recorder.record(kind, what, step)

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
        self._record("phase", f"{what} started")
        try:
            yield
        finally:
            self._record("phase", f"{what} finished")
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
        return timeout, (
            f"max(min {self.min_timeout_s:g} s, {self.factor:g} x median step time {median:.4g} s "
            f"of the last {len(self._times)} steps) = {timeout:.4g} s"
        )

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
        step = (
            "none yet"
            if self._last_step is None
            else (
                f"{self._last_step[0]} ({'untimed' if self._last_step[1] is None else f'{self._last_step[1]:.4g} s'})"
            )
        )
        median = f"{statistics.median(self._times):.4g} s" if self._times else "n/a"
        lines = [
            f"hang watchdog: {headline}",
            f"time (UTC): {datetime.now(UTC).isoformat(timespec='seconds')}",
            f"host: {self.host}",
            f"pid: {os.getpid()}",
            f"timeout: {derivation}",
            f"last completed step: {step}; recent median step time {median}",
            f"last progress: {self._last_what}, {idle:.1f} s ago",
            "",
            "Python stacks of every thread:",
        ]
        return "\n".join(lines) + "\n" + _all_stacks()

    def _fire(self, report: str) -> None:
        # Stacks first and durably: describe() may block or crash, and the stacks matter most. Then the flight
        # records of every reachable process and which process the run waits for, while the others still wait.
        headline, flight = report.splitlines()[0], ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_durably(self.path, report)
            if self.recorder is not None:
                written = _call_with_timeout(lambda: str(self.recorder.hang(headline) or ""), DESCRIBE_TIMEOUT_S)
                flight = f"; flight record in {self.recorder.run_dir / 'flight'}" + (
                    f", hang report {written}" if written.endswith(".json") else ""
                )
            described = _call_with_timeout(self.describe, DESCRIBE_TIMEOUT_S) or "(describe() returned nothing)"
            report += "\nWhat the compiled step communicates:\n" + described
            _write_durably(self.path, report + "\n")
            where = str(self.path)
        except OSError as e:  # a full or gone disk must not stop the exit: a stuck job wastes the cluster
            where = f"nowhere ({e}); stacks follow on stderr\n{report}"
        print(f"{headline}; report in {where}{flight}; exiting {EXIT_HANG}", file=sys.stderr)
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
        parts.append(
            f"\nThread {name!r} (id {ident}{', daemon' if daemon else ''}), most recent call last:\n"
            + "".join(traceback.format_stack(frame))
        )
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
