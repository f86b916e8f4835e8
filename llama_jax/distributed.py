"""Joining a multi-process run: JAX's own multi-controller runtime (`jax.distributed`), nothing home-made.

Every process of a run executes the same command; one of them (process 0) hosts JAX's coordination
service at `run.coordinator`, and each knows the process count and its own id. They come from, first
to last:

    run.coordinator, run.num_processes, run.process_id        (config / key=value)
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (environment, e.g. set by launch/)
    JAX's cluster detection: Slurm (srun), Open MPI (mpirun), Cloud TPU

A single process (nothing set, or a detected cluster of one task) does not initialise anything.
On GPU machines with one process per GPU, each process sees only its own GPU (`run.local_device_ids`,
or JAX_LOCAL_DEVICE_IDS, or Slurm's local task id). The coordinator must answer within
`run.init_timeout_s`; when a process dies, the coordination service notices within
`run.heartbeat_timeout_s` and the others stop instead of waiting forever in a collective.

Once joined, `Peers` makes every decision the processes must share outside the jitted step (barriers,
broadcasts, reductions, announcements two steps ahead) through JAX's coordination service, each wait
bounded by fault.barrier_timeout_s and naming the processes that did not come; `HostWindow` posts this
process's step timing for the per-host straggler scores.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import jax
from jax._src import distributed as jax_distributed

from llama_jax.config import RunConfig
from llama_jax.errors import ConfigError, CoordinatorUnavailable, PeerTimeout
from llama_jax.resilience import HostScores, ranges

T = TypeVar("T")

_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


@dataclass(frozen=True)
class Membership:
    """This process's place in the run; `coordinator` None when JAX's cluster detection fills it in."""
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    detected: str | None  # the cluster kind JAX will detect ("slurm", "ompi", ...), if any


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got '{value}'") from None


def _detected_cluster() -> tuple[str, int] | None:
    """(kind, process count) of a cluster environment JAX can read on its own, if there is one."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_STEP_NODELIST" in os.environ:
        return "slurm", _env_int("SLURM_NTASKS") or 1
    if "OMPI_COMM_WORLD_SIZE" in os.environ and "OMPI_MCA_orte_hnp_uri" in os.environ:
        return "ompi", _env_int("OMPI_COMM_WORLD_SIZE") or 1
    return None


def membership(run: RunConfig) -> Membership | None:
    """Who this process is in a multi-process run, or None for a single-process run. Raises ConfigError."""
    coordinator = run.coordinator or os.environ.get(_ENV["coordinator"], "").strip() or None
    num_processes = run.num_processes or _env_int(_ENV["num_processes"])
    process_id = run.process_id if run.process_id >= 0 else _env_int(_ENV["process_id"])
    detected = _detected_cluster()
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if not explicit:
        if detected is None or detected[1] <= 1:
            return None
        return Membership(None, None, None, detected[0])
    if detected is None and None in (coordinator, num_processes, process_id):
        missing = [f"run.{k} (or {_ENV[k]})" for k, v in
                   (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
                   if v is None]
        raise ConfigError(f"a multi-process run needs {', '.join(missing)}; set all three, e.g. "
                          "run.coordinator=HOST0:1234 run.num_processes=2 run.process_id=0")
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"run.num_processes must be >= 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"run.process_id must be in [0, {num_processes}) for {num_processes} processes, "
                          f"got {process_id}")
    if coordinator is not None and not _is_host_port(coordinator):
        raise ConfigError(f"run.coordinator must be HOST:PORT (the address of process 0), got '{coordinator}'")
    if num_processes == 1:
        return None
    return Membership(coordinator, num_processes, process_id, detected[0] if detected else None)


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def local_device_ids(run: RunConfig) -> list[int] | None:
    """The accelerators this process drives (None: all it sees, or JAX's own choice)."""
    if run.local_device_ids:
        return list(run.local_device_ids)
    return None  # JAX_LOCAL_DEVICE_IDS and Slurm's local id are read by jax.distributed itself


def initialize(run: RunConfig) -> Membership | None:
    """Join the run described by `run` and the environment; a no-op for a single process, and for a
    process that has already joined (a second `train` call in one script).

    Raises ConfigError on inconsistent settings and CoordinatorUnavailable when the coordinator does
    not answer within run.init_timeout_s.
    """
    member = membership(run)
    if member is None or jax.distributed.is_initialized():
        return member
    if member.coordinator is not None and member.process_id != 0:
        # JAX aborts the process (no exception to catch) when the coordinator never answers; a plain
        # TCP probe first turns the common case, a wrong address or a coordinator not up, into one line.
        wait_for_coordinator(member.coordinator, run.init_timeout_s, member.process_id)
    print(f"joining the run at {member.coordinator or member.detected} as process "
          f"{'(detected)' if member.process_id is None else member.process_id} of "
          f"{member.num_processes or '(detected)'}", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(
            coordinator_address=member.coordinator, num_processes=member.num_processes,
            process_id=member.process_id, local_device_ids=local_device_ids(run),
            initialization_timeout=int(run.init_timeout_s), heartbeat_timeout_seconds=int(run.heartbeat_timeout_s))
    except Exception as err:  # jaxlib raises its own runtime error types; keep the first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = member.coordinator or f"the coordinator {member.detected} names"
        raise CoordinatorUnavailable(
            f"could not join the run at {where} within {run.init_timeout_s:g}s as process "
            f"{member.process_id if member.process_id is not None else '?'} ({first[:300]}); check that "
            "process 0 is running and the address and port are reachable from this host") from None
    return member


def wait_for_coordinator(address: str, timeout_s: float, process_id: int | None) -> None:
    """Return once a TCP connection to address succeeds; CoordinatorUnavailable after timeout_s."""
    host, _, port = address.rpartition(":")
    deadline, last_error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            last_error = err
            time.sleep(0.5)
    raise CoordinatorUnavailable(
        f"process {process_id} could not reach the coordinator at {address} within {timeout_s:g}s "
        f"({last_error}); check that process 0 is running there and the port is open to this host "
        "(run.coordinator, run.init_timeout_s)")


class Peers:
    """The processes of a run agreeing outside the jitted step, through JAX's coordination service (its
    barriers and key-value store, the same service `jax.distributed` joined), every wait bounded.

    A process that does not arrive within `timeout_s` is named: every waiting process raises PeerTimeout
    (exit 76, which the supervisor restarts on) instead of waiting forever in a device collective. Every
    process must make the same calls in the same order, as for any collective: a call's keys carry its
    sequence number and the instance's (the processes create their Peers in the same order too, and each
    counts its own in the store), so no two calls share one, also when a script trains or converts twice.
    In a one-process run every call returns at once.

    `stall_at` is fault injection (fault.inject_stall_at): this process never arrives at that barrier.
    """

    def __init__(self, timeout_s: float, stall_at: str = "", client=None):
        self.timeout_s, self.stall_at = timeout_s, stall_at
        self.count, self.index = jax.process_count(), jax.process_index()
        # JAX has no public handle on its coordination client; Orbax reads the same attribute.
        self.client = client if client is not None or self.count == 1 else jax_distributed.global_state.client
        self._calls = 0
        instance = self.client.key_value_increment(f"llama_jax/instances/{self.index}", 1) if self.count > 1 else 0
        self._prefix = f"llama_jax/{instance}"  # every key of this instance starts with it
        self._finished: list[str] = []  # key prefixes every process is done with (deleted by process 0)
        self._announced: set[tuple[str, int]] = set()  # process 0's announcements not yet deleted

    def _key(self, name: str) -> str:
        self._calls += 1
        return f"{self._prefix}/{self._calls}/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"

    def barrier(self, name: str) -> None:
        """Return when every process has called barrier(name); PeerTimeout naming the absent ones."""
        if self.count > 1:
            self._meet(self._key(name), name)

    def _meet(self, key: str, name: str) -> None:
        while name == self.stall_at:  # injected: this process never arrives
            time.sleep(3600)
        self.client.key_value_set(f"{key}/arrived/{self.index}", socket.gethostname())
        try:
            self.client.wait_at_barrier(key, int(self.timeout_s * 1000))
        except Exception:  # jaxlib's runtime error: DEADLINE_EXCEEDED, or the barrier failed elsewhere
            raise self._absent(key, name) from None
        if self.index == 0:  # everyone has passed this barrier, so no one reads the earlier keys again
            for done in self._finished:
                self.client.key_value_delete(done)
            self._finished[:] = [key]

    def _absent(self, key: str, name: str) -> PeerTimeout:
        try:
            arrived = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get(f"{key}/arrived/")}
        except Exception:  # the coordinator itself is gone: process 0 stopped
            arrived = set(range(1, self.count)) if self.index else set()
        missing = sorted(set(range(self.count)) - arrived)
        if not missing:  # all came, but one of them had given up already and failed the barrier for all
            return PeerTimeout(f"'{name}': the barrier failed: a process gave up waiting before all arrived "
                               f"(fault.barrier_timeout_s {self.timeout_s:g}s); stopping so that a restart brings "
                               "every process back together")
        return PeerTimeout(f"'{name}': process{'es' * (len(missing) != 1)} {ranges(missing)} of {self.count} did "
                           f"not arrive within {self.timeout_s:g}s (fault.barrier_timeout_s); process {self.index} "
                           "stops too, so a restart (llama-jax supervise) brings every process back together; "
                           "look for a hang report or an error in the absent processes' logs")

    def broadcast(self, name: str, value: Any) -> Any:
        """Process 0's `value` (JSON-serialisable) on every process: one decision for all."""
        if self.count == 1:
            return value
        key = self._key(name)
        if self.index == 0:
            self.client.key_value_set(f"{key}/value", json.dumps(value))
            self._finished.append(key)
            return value
        try:
            return json.loads(self.client.blocking_key_value_get(f"{key}/value", int(self.timeout_s * 1000)))
        except Exception:
            raise PeerTimeout(f"'{name}': process 0 did not decide within {self.timeout_s:g}s "
                              "(fault.barrier_timeout_s); stopping so that a restart brings every process back") from None

    def reduce(self, name: str, value: Any, combine: Callable[[list], Any]) -> Any:
        """combine(every process's value), computed once by process 0 and returned on every process."""
        if self.count == 1:
            return combine([value])
        key = self._key(name)
        self.client.key_value_set(f"{key}/value/{self.index}", json.dumps(value))
        self._meet(key, name)
        if self.index == 0:
            value = combine([json.loads(v) for _, v in self.client.key_value_dir_get(f"{key}/value/")])
        return self.broadcast(f"{name} (result)", value)

    def any(self, name: str, flag: bool) -> bool:
        """Whether `flag` holds on some process."""
        return bool(self.reduce(name, bool(flag), any))

    # Decisions taken ahead, so no process waits. The train loop reads step n's result only after
    # dispatching step n + 1, and asks about step n + 1 after that read. So process 0 announces, when it
    # asks about step n, what happens at step n + 2: a process asking about n + 2 has read step n + 1's
    # result, and step n + 1 cannot finish before process 0 has dispatched it (the train step's collectives
    # span every process), which is after the announcement: reading it never waits. Once process 0 asks
    # about step m it has read step m - 1's result, so every process has dispatched step m - 1 and asked
    # about every step before it: announcements of steps below m - 1 are read everywhere and deleted.

    def announce(self, topic: str, step: int) -> None:
        """Process 0: `topic` happens at `step` everywhere."""
        self._announced.add((topic, step))
        if self.count > 1:
            self.client.key_value_set(f"{self._prefix}/announced/{topic}/{step}", "1")

    def announced(self, topic: str, step: int) -> bool:
        """Whether process 0 announced `topic` for `step`; every process calls this after every step."""
        if self.index == 0:
            for old in [a for a in self._announced if a[0] == topic and a[1] < step - 1]:
                self._announced.discard(old)
                if self.count > 1:
                    self.client.key_value_delete(f"{self._prefix}/announced/{topic}/{old[1]}")
            return (topic, step) in self._announced
        try:
            return self.client.key_value_try_get(f"{self._prefix}/announced/{topic}/{step}") == "1"
        except Exception:  # NOT_FOUND: nothing announced for this step
            return False

    # Reports that no one waits for: a process posts, process 0 reads what has arrived.

    def post(self, topic: str, value: Any) -> None:
        if self.count > 1:
            self.client.key_value_set(f"{self._prefix}/posts/{topic}/{self.index}", json.dumps(value))

    def read(self, topic: str) -> dict[int, Any]:
        """Process 0: the posts on `topic` so far, by process, and they are deleted (each is read once)."""
        if self.count == 1:
            return {}
        posts = self.client.key_value_dir_get(f"{self._prefix}/posts/{topic}/")
        self.client.key_value_delete(f"{self._prefix}/posts/{topic}")
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in posts}


@dataclass
class HostWindow:
    """This process's step and host times (resilience.HostScores) over each window of `every` (>= 2) steps,
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
        self.peers.post(f"hosts/{len(self._windows)}", {
            "host_s": statistics.median(self._host_s), "step_s": statistics.median(self._step_s),
            "steps": len(self._step_s), "host": self.host, "devices": self.devices})
        self._windows.append((step - len(self._step_s) + 1, step))
        self._step_s.clear(), self._host_s.clear()
        if self.peers.index != 0 or len(self._windows) < 2:
            return None
        return self.scores.observe(self._windows[-2], self.peers.read(f"hosts/{len(self._windows) - 2}"))


def primary_first(fn: Callable[[], T], errors: tuple[type[Exception], ...], peers: Peers) -> T:
    """fn() on process 0, then on the others: work with a shared side effect, such as preparing the data
    into a cache every process reads, is done once. If process 0 fails with one of `errors`, the others
    raise it too (naming process 0) instead of waiting for it; they wait at most peers.timeout_s."""
    if peers.count == 1:
        return fn()
    primary = peers.index == 0
    result, failure = None, None
    if primary:
        try:
            result = fn()
        except errors as err:
            failure = err
    failed = peers.broadcast("data prepared by process 0", failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise errors[0]("process 0 stopped on bad input (its output says why); stopping too")
    return result if primary else fn()
