"""The flight recorder: what every process of a run was last doing, so that a hang names the process the
others wait for, and what it was doing, instead of leaving one stack dump per host to compare by hand.

Each process keeps its last `fault.flight_events` events in memory (a bounded deque: an append under a lock
on the hot path, no I/O): a step dispatched or read, a barrier or agreement entered and left, a checkpoint
phase, with wall-clock times. A daemon thread publishes a small heartbeat (the newest event, its step and
time) every `fault.flight_heartbeat_s` through JAX's coordination service, the key-value store that
`jax.distributed` joined (peers.py uses the same one), and looks for a hang flag there.

On a hang -- the watchdog fires (watchdog.py), or a barrier times out (peers.py) -- the process that notices
first raises the flag; every reachable process then writes its record to ``<run.dir>/flight/process-<i>.json``,
and the first writes ``<run.dir>/hang_report.json``:

    waiting_for   the processes the others wait for, with their host and last event: a barrier's absent
                  processes when a barrier timed out, else those whose heartbeat stopped (a stopped or dead
                  process; a SIGSTOP), else those furthest behind in steps
    processes     every process's last heartbeat: step, phase, how long ago
    reason        the watchdog's or the barrier's headline

A process whose coordination service is gone (process 0 stopped) still writes its own record and a report from
what the run directory holds: the processes that wrote no record are the ones waited for.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

HANG_REPORT = "hang_report.json"
_PREFIX = "llama_jax/flight"
_RPC_TIMEOUT_S = 5.0  # a call to a coordination service that stopped answering (process 0 SIGSTOPped) must end


class FlightRecorder:
    """One process's recent events and heartbeat. `client` is JAX's distributed client (None: one process,
    nothing is published; the record and the report are still written)."""

    def __init__(
        self,
        run_dir: Path,
        process: int,
        processes: int,
        host: str,
        *,
        capacity: int = 256,
        heartbeat_s: float = 2.0,
        client: Any = None,
    ):
        self.run_dir, self.process, self.processes, self.host = Path(run_dir), process, processes, host
        self.heartbeat_s, self.client = heartbeat_s, client
        self.events: deque[tuple[float, str, str, int | None]] = deque(maxlen=capacity)
        self.step: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dumped = False  # this process's record is written (once per attempt)
        self._exiting = False  # this process is ending on a hang: its heartbeat stops for that reason
        self.record("start", "process started")

    # The hot path: an append under a lock.

    def record(self, kind: str, what: str, step: int | None = None) -> None:
        with self._lock:
            if step is not None:
                self.step = step
            self.events.append((time.time(), kind, what, self.step))

    def last(self) -> dict:
        """The heartbeat: what this process was last doing (before it noticed a hang, if it did)."""
        with self._lock:
            at, kind, what, step = next((e for e in reversed(self.events) if e[1] != "hang"), self.events[-1])
        return {
            "process": self.process,
            "host": self.host,
            "pid": os.getpid(),
            "step": step,
            "kind": kind,
            "phase": what,
            "since": at,
            "beat": time.time(),
            "events": len(self.events),
            "exiting": self._exiting,
        }

    # The heartbeat thread.

    def __enter__(self) -> FlightRecorder:
        if self.client is not None and self.processes > 1:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="flight-recorder", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + _RPC_TIMEOUT_S)
        self._thread = None

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                beat = json.dumps(self.last())
                self.client.key_value_set(f"{_PREFIX}/beat/{self.process}", beat, allow_overwrite=True)
                flagged = self.client.key_value_try_get(f"{_PREFIX}/hang")
            except Exception:  # NOT_FOUND (no hang), or the service is gone: nothing to publish to
                flagged = None
            if flagged and not self._dumped:  # another process noticed a hang: leave this one's record
                self.write_record(json.loads(flagged).get("reason", "a hang elsewhere"))
            self._stop.wait(self.heartbeat_s)

    # On a hang.

    def write_record(self, reason: str) -> Path:
        """<run.dir>/flight/process-<i>.json: this process's events, newest last."""
        self._dumped = True
        with self._lock:
            events = [{"time": at, "kind": kind, "what": what, "step": step} for at, kind, what, step in self.events]
        path = self.run_dir / "flight" / f"process-{self.process}.json"
        _write_json(path, {**self.last(), "reason": reason, "recent_events": events})
        return path

    def hang(self, reason: str, waiting_for: list[int] | None = None) -> Path | None:
        """A hang noticed here (the watchdog's timeout, or a barrier's): write this process's record, flag the
        hang for the others, and, if this process flagged it first, write the run's hang report. Returns the
        report's path when this process wrote it. Every wait is bounded: the process must still exit."""
        self._exiting = True
        self.record("hang", reason)
        self.write_record(reason)
        first, beats = True, None
        if self.client is not None and self.processes > 1:
            flag = json.dumps({"by": self.process, "reason": reason})
            # Exiting, not stopped: a heartbeat that ends now must not make this process one the run waits for.
            _bounded(
                lambda: self.client.key_value_set(
                    f"{_PREFIX}/beat/{self.process}", json.dumps(self.last()), allow_overwrite=True
                ),
                None,
            )
            first = _bounded(lambda: self.client.key_value_increment(f"{_PREFIX}/hang-count", 1) == 1, True)
            if first:
                _bounded(lambda: self.client.key_value_set(f"{_PREFIX}/hang", flag, allow_overwrite=True), None)
                # The others see the flag at their next heartbeat and leave their records.
                time.sleep(min(2 * self.heartbeat_s + 0.5, 30.0))
                beats = _bounded(
                    lambda: {
                        int(k.rsplit("/", 1)[1]): json.loads(v)
                        for k, v in self.client.key_value_dir_get(f"{_PREFIX}/beat/")
                    },
                    None,
                )
        if not first:
            # Process 0 hosts the coordination service: the reporter reads it until it has written the report.
            window = 2 * self.heartbeat_s + 3 * _RPC_TIMEOUT_S
            _bounded(
                lambda: self.client.blocking_key_value_get(f"{_PREFIX}/reported", int(window * 1000)),
                None,
                timeout_s=window + 1,
            )
            return None
        report = hang_report(
            reason,
            self.process,
            self.processes,
            beats,
            self._records(),
            waiting_for,
            stale_after_s=3 * self.heartbeat_s,
            now=time.time(),
        )
        path = self.run_dir / HANG_REPORT
        _write_json(path, report)
        if self.client is not None and self.processes > 1:
            _bounded(lambda: self.client.key_value_set(f"{_PREFIX}/reported", "1", allow_overwrite=True), None)
        return path

    def _records(self) -> dict[int, dict]:
        records = {}
        for path in (self.run_dir / "flight").glob("process-*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            # This hang's records only: all are written within a few heartbeats (an older attempt's are older).
            if time.time() - float(record.get("beat", 0)) <= 2 * self.heartbeat_s + 3 * _RPC_TIMEOUT_S:
                records[int(record["process"])] = record
        return records


def hang_report(
    reason: str,
    reporter: int,
    processes: int,
    beats: dict[int, dict] | None,
    records: dict[int, dict],
    waiting_for: list[int] | None,
    stale_after_s: float,
    now: float,
) -> dict:
    """The report: who the run waits for and what every process was last doing. `beats`: every process's last
    heartbeat from the coordination service (None: unreachable); `records`: the records written this attempt."""
    last = _last_known(processes, beats, records)
    seen = {p: v for p, v in last.items() if v}
    if waiting_for:
        why = "absent from the barrier that timed out"
    else:
        waiting_for, why = _waited_for(processes, beats, seen, stale_after_s, now)
    return {
        "reason": reason,
        "reported_by": reporter,
        "time": now,
        "waiting_for": [_entry(p, last, now) for p in waiting_for],
        "why": why,
        "processes": [_entry(p, last, now) for p in range(processes)],
        "records": sorted(f"flight/process-{p}.json" for p in records),
    }


def _last_known(processes: int, beats: dict[int, dict] | None, records: dict[int, dict]) -> dict[int, dict]:
    """Per process, what it last said: its record, else its heartbeat ({}: neither)."""
    last = {p: dict(records.get(p) or {}) for p in range(processes)}
    for p, beat in (beats or {}).items():  # a heartbeat is newer than a record only for a process that wrote none
        if not last.get(p):
            last[p] = beat
    return last


def _waited_for(
    processes: int, beats: dict[int, dict] | None, seen: dict[int, dict], stale_after_s: float, now: float
) -> tuple[list[int], str]:
    """Without a barrier's absent processes: (the processes the run waits for, why), from the heartbeats and
    records `seen`."""

    def stopped(p: int) -> bool:
        beat = (beats or {}).get(p, seen[p])
        exiting = beat.get("exiting") or seen[p].get("exiting")
        return not exiting and now - float(beat.get("beat", 0)) > stale_after_s

    stale = sorted(p for p in seen if stopped(p))
    unseen = sorted(set(range(processes)) - set(seen))
    steps = {p: v.get("step") for p, v in seen.items() if v.get("step") is not None}
    behind = (
        sorted(p for p, s in steps.items() if s == min(steps.values()))
        if steps and len(set(steps.values())) > 1
        else []
    )
    if stale or unseen:
        waiting_for, why = (
            sorted(set(stale) | set(unseen)),
            (
                f"heartbeat stopped for more than {stale_after_s:g} s"
                if beats is not None
                else "wrote no record (the coordination service did not answer)"
            ),
        )
    elif behind:
        waiting_for, why = behind, "furthest behind in steps"
    else:
        waiting_for, why = [], "every process is alive and at the same step: a collective or the devices hang"
    return waiting_for, why


def _entry(p: int, last: dict[int, dict], now: float) -> dict:
    """One process's line of the report: its host, step and phase, and how long ago it last said so."""
    v = last.get(p) or {}
    return {
        "process": p,
        "host": v.get("host", "unknown"),
        "step": v.get("step"),
        "phase": v.get("phase", "unknown"),
        "seconds_ago": round(now - float(v["since"]), 3) if "since" in v else None,
        "heartbeat_age_s": round(now - float(v["beat"]), 3) if "beat" in v else None,
    }


def _bounded(call: Callable[[], Any], default: Any, timeout_s: float = _RPC_TIMEOUT_S) -> Any:
    """call() on a thread, its result, or `default` if it fails or does not return in timeout_s."""
    result: list = []

    def run() -> None:
        try:
            result.append(call())
        except Exception:  # noqa: BLE001 - an unreachable service is one of the cases this handles
            pass

    thread = threading.Thread(target=run, daemon=True, name="flight-rpc")
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else default


def _write_json(path: Path, value: dict) -> None:
    """Written whole and flushed to disk before the process exits (os._exit follows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(value, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
