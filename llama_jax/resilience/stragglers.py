"""Stragglers: a step far slower than the rolling median, and in a multi-process run the host that the
fleet waits for (its host time per step beyond the others', scored over windows of steps)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from llama_jax.distributed.peers import Peers
from llama_jax.files import format_ranges


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
                warning = (
                    f"warning: straggler: step {step} took {seconds:.3g} s, {seconds / median:.1f}x "
                    f"the median {median:.3g} s; seen on process {process}"
                )
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
            scores.append(
                {
                    "process": process,
                    "host": r["host"],
                    "devices": r["devices"],
                    "score": round(score, 4),
                    "host_s": r["host_s"],
                    "vs_own_best": round(r["host_s"] / best, 3) if best > 0 else 1.0,
                    "straggler": self._over[process] >= self.windows,
                }
            )
            if scores[-1]["straggler"]:
                warnings.append(
                    f"warning: straggler host: process {process} on {r['host']} "
                    f"(devices {format_ranges(r['devices'])}) "
                    f"costs the fleet {r['host_s'] - median_host:.3g} s of each {step_s:.3g} s step over steps "
                    f"{steps[0]}-{steps[1]} (score {score:.2f} > fault.straggler_host_threshold {self.threshold:g}, "
                    f"{self._over[process]} windows running; {scores[-1]['vs_own_best']:.2f}x its own best)"
                )
        scores.sort(key=lambda x: -x["score"])
        return scores, waited * max(r["steps"] for r in reports.values()), warnings


@dataclass
class HostWindow:
    """This process's step and host times (HostScores) over each window of `every` (>= 2) steps,
    posted when the window closes; process 0 scores the window before. That one is complete by then: process 0
    closes window k + 1 when it reads step s = (k + 2) x every, so every process has dispatched step s, and a
    process posts window k when it reads step (k + 1) x every, before it dispatches step (k + 1) x every + 2 <= s."""

    peers: Peers
    scores: HostScores
    every: int
    host: str
    devices: list[int]
    _step_s: list[float] = field(default_factory=list)
    _host_s: list[float] = field(default_factory=list)
    _windows: list[tuple[int, int]] = field(default_factory=list)  # (first, last) step of each posted window

    def add(self, step_s: float, host_s: float) -> None:
        self._step_s.append(step_s)
        self._host_s.append(host_s)

    def close(self, step: int) -> tuple[list[dict], float, list[str]] | None:
        """Post the window ending at `step`; on process 0, the previous window's scores (HostScores.observe)."""
        if self.peers.count == 1 or not self._step_s:
            self._step_s.clear(), self._host_s.clear()
            return None
        self.peers.post(
            f"hosts/{len(self._windows)}",
            {
                "host_s": statistics.median(self._host_s),
                "step_s": statistics.median(self._step_s),
                "steps": len(self._step_s),
                "host": self.host,
                "devices": self.devices,
            },
        )
        self._windows.append((step - len(self._step_s) + 1, step))
        self._step_s.clear(), self._host_s.clear()
        if self.peers.index != 0 or len(self._windows) < 2:
            return None
        return self.scores.observe(self._windows[-2], self.peers.read(f"hosts/{len(self._windows) - 2}"))
