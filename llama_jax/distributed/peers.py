"""The processes of a run agreeing outside the jitted step: barriers, broadcasts, reductions, announcements
two steps ahead and posts, through JAX's coordination service, every wait bounded by
fault.barrier_timeout_s and naming the processes that did not come.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from llama_jax.distributed.processes import node_name
from llama_jax.errors import PeerTimeout
from llama_jax.files import format_ranges
from llama_jax.model.jax_workarounds import distributed_client

T = TypeVar("T")


class Peers:
    """The processes of a run agreeing outside the jitted step, through JAX's coordination service (its
    barriers and key-value store, the same service `jax.distributed` joined), every wait bounded.

    A process that does not arrive within `timeout_s` is named: every waiting process raises PeerTimeout
    (exit 76, which the supervisor restarts on) instead of waiting forever in a device collective. Every
    process must make the same calls in the same order, as for any collective: a call's keys carry its
    sequence number and the instance's (the processes create their Peers in the same order too, and each
    counts its own in the store), so no two calls share one, also when a script trains or converts twice.
    In a one-process run every call returns at once.

    `injected_stall_at` is fault injection, for tests only (resilience/inject.py's Injector.stall_at): this process
    never arrives at the barrier of that name.
    `recorder` (resilience/flight.py's FlightRecorder, or None) is told of every wait, and of a barrier that
    timed out, naming the absent processes.
    """

    def __init__(self, timeout_s: float, injected_stall_at: str = "", client=None, recorder=None):
        self.timeout_s, self.injected_stall_at, self.recorder = timeout_s, injected_stall_at, recorder
        self.count, self.index = jax.process_count(), jax.process_index()
        # JAX has no public handle on its coordination client (jax_workarounds.py); Orbax reads the same one.
        self.client = client if client is not None or self.count == 1 else distributed_client()
        self._calls = 0
        instance = self.client.key_value_increment(f"llama_jax/instances/{self.index}", 1) if self.count > 1 else 0
        self._prefix = f"llama_jax/{instance}"  # every key of this instance starts with it
        if self.count > 1:  # where each process runs, so that one that never arrives somewhere can be found
            self.client.key_value_set(f"{self._prefix}/hosts/{self.index}", node_name())
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
        while name == self.injected_stall_at:  # injected: this process never arrives
            time.sleep(3600)
        self._record("barrier", f"barrier '{name}' entered")
        self.client.key_value_set(f"{key}/arrived/{self.index}", "1")
        try:
            self.client.wait_at_barrier(key, int(self.timeout_s * 1000))
        except Exception:  # jaxlib's runtime error: DEADLINE_EXCEEDED, or the barrier failed elsewhere
            absent = self._absent(key, name)
            if self.recorder is not None:
                self.recorder.hang(str(absent), waiting_for=absent.missing)
            raise absent from None
        self._record("barrier", f"barrier '{name}' passed")
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
            return PeerTimeout(
                f"'{name}': the barrier failed: a process gave up waiting before all arrived "
                f"(fault.barrier_timeout_s {self.timeout_s:g}s); stopping so that a restart brings "
                "every process back together"
            )
        absent = f"process{'es' * (len(missing) != 1)} {format_ranges(missing)}"
        return PeerTimeout(
            f"'{name}': {absent} of {self.count} did not arrive within {self.timeout_s:g}s (fault.barrier_timeout_s), "
            f"on {self._where(missing)}; process {self.index} stops too, so a restart (llama-jax supervise) brings "
            "every process back together; look for a hang report or an error in the absent processes' logs",
            missing,
        )

    def _record(self, kind: str, what: str) -> None:
        if self.recorder is not None:
            self.recorder.record(kind, what)

    def _where(self, processes: list[int]) -> str:
        """The nodes of `processes`, each with its process ids: 'node-7 (process 3), node-9 (processes 8-15)'."""
        try:
            hosts = {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(f"{self._prefix}/hosts/")}
        except Exception:  # the coordinator itself is gone
            hosts = {}
        by_host: dict[str, list[int]] = {}
        for process in processes:
            by_host.setdefault(hosts.get(process, "an unknown host"), []).append(process)
        return ", ".join(
            f"{host} (process{'es' * (len(ids) > 1)} {format_ranges(ids)})" for host, ids in by_host.items()
        )

    def broadcast(self, name: str, value: Any) -> Any:
        """Process 0's `value` (JSON-serialisable) on every process: one decision for all."""
        if self.count == 1:
            return value
        key = self._key(name)
        if self.index == 0:
            self.client.key_value_set(f"{key}/value", json.dumps(value))
            self._finished.append(key)
            return value
        self._record("agreement", f"waiting for process 0's '{name}'")
        try:
            return json.loads(self.client.blocking_key_value_get(f"{key}/value", int(self.timeout_s * 1000)))
        except Exception:
            raise PeerTimeout(
                f"'{name}': process 0 did not decide within {self.timeout_s:g}s "
                "(fault.barrier_timeout_s); stopping so that a restart brings every process back"
            ) from None

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
