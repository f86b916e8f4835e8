"""The node-local checkpoint tier: frequent saves to fast storage on each host, beside the durable
``<run.dir>/checkpoints/`` (durable.py), with a copy of each process's shards on a partner host.

Each process keeps its own directory on storage only its host reads (/dev/shm, a local NVMe): its own shards
and its partner's, with a manifest of CRC-32s, in the files local_files.py describes.

Why a collective for the partner's copy, not a file copy: a host's /dev/shm or NVMe is not reachable
from another host, and any path that is (NFS) is the slow tier this one avoids. Each state leaf's
shards become rows on a line of the run's devices, and a compiled ppermute sends every row to the
partner's device: the shards travel over the interconnect the training collectives use (NCCL, or gloo
on CPUs), and the partner writes them to its own local directory. A partner is the next process on
another host, so losing a whole host (its processes and its local storage) loses no local step.

Restoring, every process reports which steps it holds (its own shards, and its partner's), and all
agree on the newest step every process can be served: from its own copy, else from the copy its
partner holds, which travels back by the same collective. Each file's tensors are checked against
their CRC-32 and the wanted shapes and dtypes; a copy that fails is set aside (renamed
``corrupt-<step>-<time>``) and the decision falls back to the next copy, the durable tier, or an
older step (checkpoint.Checkpointer.restore_newest).

On another process count or mesh (a run continuing on fewer hosts, or grown back) the steps the hosts
hold (local_files.host_pieces) are laid out on the new mesh by relayout.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.checkpoint.local_files import (
    MANIFEST,
    OWN,
    checksums,
    finished_steps,
    host_directory,
    host_pieces,
    read_arrays,
    read_manifest,
)
from llama_jax.distributed.peers import Peers
from llama_jax.distributed.processes import node_name

EXCHANGE_BYTES = 1 << 30  # per device and batch of leaves sent to partners: the exchange's memory bound


def partners(hosts: list[str]) -> list[int]:
    """partner[i]: the process that keeps process i's copy. A cyclic shift (so every process keeps exactly
    one other's copy and the copies can travel in one collective) by the smallest distance that puts
    every partner on another host; by one when all processes share a host (a simulation on one machine)."""
    n = len(hosts)
    shift = next((k for k in range(1, n) if all(hosts[(i + k) % n] != hosts[i] for i in range(n))), 1)
    return [(i + shift) % n for i in range(n)]


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its array as text, e.g. '0:4,0:8' (a scalar: '')."""
    return ",".join(f"{s.start or 0}:{shape[d] if s.stop is None else s.stop}" for d, s in enumerate(index))


def _to_host(arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """The arrays on the host, their device-to-host copies all started before the first is waited for (as
    Orbax does). On a CPU device np.asarray is a view of the device buffer, not a copy: while the writer
    holds it, jax declines to donate that buffer to the next step (measured on jax 0.10.2 and 0.12), so the
    step cannot overwrite what is being written."""
    for array in arrays.values():
        array.copy_to_host_async()
    return {name: np.asarray(array) for name, array in arrays.items()}


def _shards(array: jax.Array) -> dict[str, jax.Array]:
    """This process's distinct shards of `array` by place (replicas once), still on their devices."""
    out: dict[str, jax.Array] = {}
    for shard in array.addressable_shards:
        out.setdefault(_index_key(shard.index, array.shape), shard.data)
    return out


def _outside_the_mesh(method):
    """The run's mesh context (the run's order of devices) must not reach the arrays of rows, which live on
    single devices or on lines of devices in other orders: jax would refuse to compute on them."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with jax.set_mesh(None):
            return method(*args, **kwargs)

    return wrapped


@dataclass
class Inventory:
    """What one process holds of one step: its own copy, and whose copy besides (None: nobody's)."""

    own: bool
    holds: int | None


class LocalTier:
    """The local checkpoints of one process. Saves and restores are collectives when replicas are on:
    every process calls them for the same steps, as the train loop does (steps divisible by
    checkpoint.local_every_steps, and restore decisions taken through `peers`)."""

    def __init__(
        self, local_dir: str, run_dir: Path, mesh: Mesh, peers: Peers, keep: int, replicas: int, print_fn=print
    ):
        self.peers, self.keep, self.print_fn = peers, keep, print_fn
        self.index, self.count = peers.index, peers.count
        self.host_dir = host_directory(local_dir, run_dir)
        self.directory = self.host_dir / f"process-{self.index}"
        hosts = peers.reduce("local tier hosts", [self.index, node_name()], lambda all_: [h for _, h in sorted(all_)])
        self.replicas = replicas if self.count > 1 else 0
        self.partner = partners(hosts)  # partner[i] keeps process i's copy
        self.held = self.partner.index(self.index) if self.replicas else None  # whose copy is kept here
        if self.replicas and len(set(hosts)) == 1 and self.index == 0:
            print_fn(
                "note: every process runs on one host, so a partner's copy survives a process's loss, not the host's"
            )
        # The partners' copies travel as rows, one per device, on the run's devices in one line (`rows`):
        # a compiled ppermute sends each device's row to the partner's device at the same local position.
        # Rows, not the state's own shardings: every shard moves, replicas included, with one program for
        # many leaves, and no reshard between device orders (which jax 0.12 logs a warning for per leaf).
        self.devices = devices = list(mesh.devices.flat)
        self.local_devices = local = {
            p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in range(self.count)
        }
        to_partner = {d: local[self.partner[d.process_index]][local[d.process_index].index(d)] for d in devices}
        self.owner_of = {moved: d for d, moved in to_partner.items()}  # a device -> the device whose rows it keeps
        line = Mesh(np.array(devices), ("devices",))
        self.rows = NamedSharding(line, P("devices"))
        self.position = position = {d: i for i, d in enumerate(devices)}
        pairs = [(position[d], position[to_partner[d]]) for d in devices]
        self._send = _permutation(line, pairs)  # each row to the partner's device
        self._send_back = _permutation(line, [(b, a) for a, b in pairs])  # and back to its owner
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.save_seconds: list[float] = []  # how long each save blocked the loop
        self.write_seconds: list[float] = []  # how long each background write took
        self.bytes_written = 0  # by this host, own and partner's copies

    # ---------------------------------------------------------------------------------------------
    # Saving

    @_outside_the_mesh
    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> float:
        """Copy this process's shards (and its partner's, received now) to the host, then write them in
        the background; returns the seconds the loop was blocked. Waits for the previous write first."""
        start = time.perf_counter()
        self.wait()
        leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
        own = {f"{path}@{place}": data for path, leaf in leaves for place, data in _shards(leaf).items()}
        files = {OWN: _to_host(own)}
        if self.replicas:
            files[f"partner-{self.held}.safetensors"] = self._partner_tensors(leaves)
        manifest = {
            "step": step,
            "process": self.index,
            "processes": self.count,
            "holds": self.held,
            "data": data_state,
            "meta": meta,
        }
        self.save_seconds.append(time.perf_counter() - start)
        self._writer = threading.Thread(
            target=self._write, args=(step, files, manifest), daemon=True, name=f"local-checkpoint-{step}"
        )
        self._writer.start()
        return self.save_seconds[-1]

    def _partner_tensors(self, leaves: list[tuple[str, jax.Array]]) -> dict[str, np.ndarray]:
        """The shards of the process whose copy this one keeps, received now, on the host by place (replicas
        once). The leaves go in batches of EXCHANGE_BYTES per device, each batch on the host before the next
        is sent, which bounds the device memory the exchange takes."""
        out: dict[str, np.ndarray] = {}

        def shard_bytes(item) -> int:
            return math.prod(item[1].sharding.shard_shape(item[1].shape)) * item[1].dtype.itemsize

        for batch in _batches(leaves, shard_bytes, EXCHANGE_BYTES):
            rows = []
            for _, leaf in batch:
                shards = {shard.device: shard.data for shard in leaf.addressable_shards}
                rows.append(_rows(self.rows, lambda device, shards=shards: shards[device][None]))
            received: dict[str, jax.Array] = {}
            for (path, leaf), moved in zip(batch, self._send(*rows)):
                places = leaf.sharding.devices_indices_map(leaf.shape)
                for row in moved.addressable_shards:
                    place = _index_key(places[self.owner_of[row.device]], leaf.shape)
                    received.setdefault(f"{path}@{place}", row.data)
            out.update({key: data[0, ...] for key, data in _to_host(received).items()})  # 0-d stays an array
        return out

    def _write(self, step: int, files: dict[str, dict[str, np.ndarray]], manifest: dict) -> None:
        start = time.perf_counter()
        try:
            tmp = self.directory / f"{step}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            manifest["files"] = {name: checksums(tensors) for name, tensors in files.items()}
            for name, tensors in files.items():
                safetensors.numpy.save_file(tensors, str(tmp / name))
                self.bytes_written += (tmp / name).stat().st_size
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            final = self.directory / str(step)
            shutil.rmtree(final, ignore_errors=True)  # an older save of this step (before a rollback)
            os.rename(tmp, final)
            for old in finished_steps(self.directory)[: -self.keep]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)
        except BaseException as err:  # reported by the next wait(): a thread cannot stop the loop itself
            self._error = err
        self.write_seconds.append(time.perf_counter() - start)

    def wait(self) -> float:
        """Block until the background write is done; returns the seconds waited. A failed write is
        reported as a warning: the durable tier still protects the run."""
        start = time.perf_counter()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            self.print_fn(
                f"warning: process {self.index}: a local checkpoint write failed "
                f"({type(self._error).__name__}: {self._error}); the durable tier still holds the run"
            )
            self._error = None
        return time.perf_counter() - start

    # ---------------------------------------------------------------------------------------------
    # Restoring

    def inventory(self) -> dict[int, Inventory]:
        """Steps this process holds: its own copy and/or its partner's."""
        found: dict[int, Inventory] = {}
        for step in finished_steps(self.directory):
            manifest = read_manifest(self.directory / str(step)) or {}
            if manifest.get("processes") != self.count:  # an earlier run's, on another count: relayout.py
                continue
            names = manifest.get("files", {})
            holds = manifest.get("holds") if f"partner-{manifest.get('holds')}.safetensors" in names else None
            found[step] = Inventory(own=OWN in names, holds=holds)
        return found

    def agreed_steps(self) -> list[int]:
        """Steps, newest first, that every process can be served from the local tier by inventory: each
        process has its own copy or its partner keeps one (one list for all processes)."""
        mine = [[step, inv.own, inv.holds] for step, inv in self.inventory().items()]

        def servable(all_: list) -> list[int]:
            served: dict[int, set[int]] = {}
            for process, items in all_:
                for step, has_own, holds in items:
                    served.setdefault(step, set()).update([process] * has_own + ([holds] if holds is not None else []))
            # every process of this run is served (copies of a former, larger run's processes do not count)
            return sorted((s for s, who in served.items() if who >= set(range(self.count))), reverse=True)

        return self.peers.reduce("local steps", [self.index, mine], servable)

    def meta(self, step: int) -> dict | None:
        """The run meta saved with a local step, as the first process holding it read it (its own copy's, else
        any on its host: a process whose directory was lost has none of its own); None if no process can read it."""
        manifest = read_manifest(self.directory / str(step)) or next(
            (
                m
                for saved, _, _, where, _ in host_pieces(self.host_dir)
                if saved == step and (m := read_manifest(Path(where)))
            ),
            {},
        )
        return self.peers.reduce(
            f"local meta of step {step}",
            [self.index, manifest.get("meta")],
            lambda all_: next((m for _, m in sorted(all_, key=lambda v: v[0]) if m), None),
        )

    @_outside_the_mesh
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, str] | str:
        """(state, loader state, which copies served) for `step`, or the reason it cannot be restored
        here (a string, the same on every process). A collective: every process calls it."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]
        step_dir = self.directory / str(step)
        manifest = read_manifest(step_dir) or {}
        own, own_failure = read_arrays(step_dir, OWN, manifest, leaves, _place_own)
        held, held_failure = None, ""
        if self.replicas:
            held, held_failure = read_arrays(
                step_dir, f"partner-{self.held}.safetensors", manifest, leaves, self._place_held
            )
        report = [self.index, own is not None, held is not None, own_failure, held_failure, manifest.get("data")]
        verdicts = self.peers.reduce(f"local step {step}", report, sorted)
        data = next((v[5] for v in verdicts if v[5]), {})
        owners = {v[0] for v in verdicts if v[1]}
        served = owners | {self.partner.index(v[0]) for v in verdicts if v[2]}
        damaged = [f"process {v[0]}: {why}" for v in verdicts for why in v[3:5] if why]
        if own_failure or held_failure:
            self.set_aside(step)
        if len(served) < self.count:
            return f"local step {step} cannot be served to every process ({'; '.join(damaged) or 'copies missing'})"
        missing = sorted(set(range(self.count)) - owners)
        if missing:  # every process joins the collectives that send the kept copies back to their owners
            if held is None:  # nothing kept here: zeros stand in, and what comes back to this process is unused
                held = [
                    self._place_held(leaf, lambda _, shape, leaf=leaf: np.zeros(shape, leaf.dtype))
                    for _, leaf in leaves
                ]
            back = []
            for batch in _batches(list(zip(leaves, held)), lambda item: item[1].nbytes // len(item[1]), EXCHANGE_BYTES):
                for ((_, leaf), _), returned in zip(batch, self._send_back(*(rows for _, rows in batch))):
                    back.append(
                        jax.make_array_from_single_device_arrays(
                            leaf.shape, leaf.sharding, [row.data[0] for row in returned.addressable_shards]
                        )
                    )
            own = own if own is not None else back
        processes = f"process{'es' * (len(missing) > 1)} {', '.join(map(str, missing))}"
        source = f"own copies, and the partner's copy for {processes}" if missing else "own copies"
        return jax.tree_util.tree_unflatten(treedef, own), dict(data), source

    def _place_held(self, leaf, data_at) -> jax.Array:
        """The rows of the process whose copy this one keeps, each on the device that received it."""
        places, shape = leaf.sharding.devices_indices_map(leaf.shape), leaf.sharding.shard_shape(leaf.shape)
        return _rows(
            self.rows, lambda device: data_at(_index_key(places[self.owner_of[device]], leaf.shape), shape)[None]
        )

    def set_aside(self, step: int) -> None:
        """Rename this process's copy of a damaged step out of sight, keeping its files for inspection."""
        source = self.directory / str(step)
        if source.is_dir():
            os.rename(source, self.directory / f"corrupt-{step}-{time.strftime('%Y%m%dT%H%M%S')}")


def _place_own(leaf, data_at) -> jax.Array:
    """`leaf` as the run shards it, with this process's shards from data_at(place, shard shape)."""
    places, shape = leaf.sharding.devices_indices_map(leaf.shape), leaf.sharding.shard_shape(leaf.shape)
    pieces = [
        jax.device_put(data_at(_index_key(places[d], leaf.shape), shape), d) for d in leaf.sharding.addressable_devices
    ]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces)


def _rows(sharding: NamedSharding, row_on) -> jax.Array:
    """An array of rows, one per device of a line of devices, from this process's rows (row_on(device),
    each of shape [1, ...])."""
    pieces = [jax.device_put(row_on(device), device) for device in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(
        (sharding.mesh.devices.size, *pieces[0].shape[1:]), sharding, pieces
    )


def _permutation(line: Mesh, pairs: list[tuple[int, int]]):
    """A compiled function sending each row of its arguments (arrays of rows on `line`) from device
    position a to position b for each (a, b) in pairs: one ppermute per argument, in one program."""

    def send(*rows):
        return [jax.lax.ppermute(row, "devices", pairs) for row in rows]

    return jax.jit(jax.shard_map(send, mesh=line, in_specs=P("devices"), out_specs=P("devices")))


def _batches(items: list, bytes_of, budget: int) -> list[list]:
    """items in order, in batches whose bytes per device (bytes_of(item)) total at most `budget`, or one
    item when it alone is bigger."""
    batches: list[list] = [[]]
    used = 0
    for item in items:
        size = bytes_of(item)
        if batches[-1] and used + size > budget:
            batches.append([])
            used = 0
        batches[-1].append(item)
        used += size
    return [batch for batch in batches if batch]
