"""The node-local checkpoint tier: frequent saves to fast storage on each host, beside the durable
``<run.dir>/checkpoints/`` (checkpoint.py), with a copy of each process's shards on a partner host.

Each process keeps its own directory, ``<checkpoint.local_dir>/<run>/process-<i>/``, on storage only it
reads (/dev/shm, a local NVMe). A finished step is a directory ``<step>/`` holding

    own.safetensors        this process's shards of the train state (each distinct shard once)
    partner-<j>.safetensors the shards of process j, sent here with checkpoint.local_replicas=1
    manifest.json          the step, a CRC-32 of every tensor, the loader position and the run's meta

written under a temporary name and renamed when complete, so a step directory that exists is finished.

Why a collective for the partner's copy, not a file copy: a host's /dev/shm or NVMe is not reachable
from another host, and any path that is (NFS) is the slow tier this one avoids. The copy is one
device_put of each state leaf onto the same mesh with every process's devices replaced by its
partner's: the shards travel over the interconnect the training collectives use (NCCL, or gloo on
CPUs), and the partner writes them to its own local directory. A partner is the next process on
another host, so losing a whole host (its processes and its local storage) loses no local step.

Restoring, every process reports which steps it holds (its own shards, and its partner's), and all
agree on the newest step every process can be served: from its own copy, else from the copy its
partner holds, which travels back by the same collective. Each file's tensors are checked against
their CRC-32 and the wanted shapes and dtypes; a copy that fails is set aside (renamed
``corrupt-<step>-<time>``) and the decision falls back to the next copy, the durable tier, or an
older step (checkpoint.Checkpointer.restore_newest).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.distributed import Peers

OWN = "own.safetensors"
MANIFEST = "manifest.json"


def process_directory(local_dir: str, run_dir: Path, process: int) -> Path:
    """This process's directory of the local tier. The run's name and a hash of its absolute path keep
    runs that share a local_dir apart."""
    run_dir = Path(run_dir).absolute()
    key = f"{run_dir.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"
    return Path(local_dir).expanduser().absolute() / key / f"process-{process}"


def finished_steps(directory: Path) -> list[int]:
    """Finished local steps (directories with a manifest), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / MANIFEST).is_file())


def read_manifest(step_dir: Path) -> dict | None:
    try:
        return json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


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


def _shards(array: jax.Array) -> dict[str, np.ndarray]:
    """This process's distinct shards of `array`, on the host, by place (replicas once)."""
    out: dict[str, np.ndarray] = {}
    for shard in array.addressable_shards:
        key = _index_key(shard.index, array.shape)
        if key not in out:
            out[key] = np.array(shard.data)  # a copy: the next step may donate (reuse) the device buffer
    return out


def _checksums(tensors: dict[str, np.ndarray]) -> dict[str, int]:
    return {name: zlib.crc32(np.ascontiguousarray(t).view(np.uint8).reshape(-1)) for name, t in tensors.items()}


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

    def __init__(self, local_dir: str, run_dir: Path, mesh: Mesh, peers: Peers, keep: int, replicas: int,
                 log=print):
        self.peers, self.keep, self.log = peers, keep, log
        self.index, self.count = peers.index, peers.count
        self.directory = process_directory(local_dir, run_dir, self.index)
        hosts = peers.reduce("local tier hosts", [self.index, socket.gethostname()],
                             lambda all_: [h for _, h in sorted(all_)])
        self.replicas = replicas if self.count > 1 else 0
        self.partner = partners(hosts)  # partner[i] keeps process i's copy
        self.held = self.partner.index(self.index) if self.replicas else None  # whose copy is kept here
        if self.replicas and len(set(hosts)) == 1 and self.index == 0:
            log("note: every process runs on one host, so a partner's copy survives a process's loss, not the host's")
        # The partners' copies travel as rows, one per device: the run's devices in one line (`rows`), and
        # the same line with each device replaced by its partner's device at the same local position
        # (`partner_rows`). Putting an array of rows from one onto the other moves every row to the partner.
        # Rows, not the state's own shardings: a replicated shard would not move (jax takes replicas to be
        # equal and keeps each device's own), so a process that lost its copy would get its placeholder back.
        devices = list(mesh.devices.flat)
        local = {p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in range(self.count)}
        to_partner = {d: local[self.partner[d.process_index]][local[d.process_index].index(d)] for d in devices}
        self.owner_of = {moved: d for d, moved in to_partner.items()}  # a device -> the device whose rows it keeps
        self.rows = NamedSharding(Mesh(np.array(devices), ("devices",)), P("devices"))
        self.partner_rows = NamedSharding(Mesh(np.array([to_partner[d] for d in devices]), ("devices",)), P("devices"))
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
        self.wait()
        start = time.perf_counter()
        leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
        files = {OWN: {f"{path}@{place}": data for path, leaf in leaves for place, data in _shards(leaf).items()}}
        if self.replicas:
            files[f"partner-{self.held}.safetensors"] = self._partner_tensors(leaves)
        manifest = {"step": step, "process": self.index, "processes": self.count, "holds": self.held,
                    "data": data_state, "meta": meta}
        self.save_seconds.append(time.perf_counter() - start)
        self._writer = threading.Thread(target=self._write, args=(step, files, manifest), daemon=True,
                                        name=f"local-checkpoint-{step}")
        self._writer.start()
        return self.save_seconds[-1]

    def _partner_tensors(self, leaves: list[tuple[str, jax.Array]]) -> dict[str, np.ndarray]:
        """The shards of the process whose copy this one keeps, received now, by place (replicas once)."""
        out: dict[str, np.ndarray] = {}
        for path, leaf in leaves:
            shards = {shard.device: shard.data for shard in leaf.addressable_shards}
            rows = _rows(self.rows, lambda device: shards[device][None])
            places = leaf.sharding.devices_indices_map(leaf.shape)
            for row in _moved(rows, self.partner_rows).addressable_shards:
                out.setdefault(f"{path}@{_index_key(places[self.owner_of[row.device]], leaf.shape)}",
                               np.array(row.data)[0, ...])
        return out

    def _write(self, step: int, files: dict[str, dict[str, np.ndarray]], manifest: dict) -> None:
        start = time.perf_counter()
        try:
            tmp = self.directory / f"{step}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            manifest["files"] = {name: _checksums(tensors) for name, tensors in files.items()}
            for name, tensors in files.items():
                safetensors.numpy.save_file(tensors, str(tmp / name))
                self.bytes_written += (tmp / name).stat().st_size
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            final = self.directory / str(step)
            shutil.rmtree(final, ignore_errors=True)  # an older save of this step (before a rollback)
            os.rename(tmp, final)
            for old in finished_steps(self.directory)[:-self.keep]:
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
            self.log(f"warning: process {self.index}: a local checkpoint write failed "
                     f"({type(self._error).__name__}: {self._error}); the durable tier still holds the run")
            self._error = None
        return time.perf_counter() - start

    # ---------------------------------------------------------------------------------------------
    # Restoring

    def inventory(self) -> dict[int, Inventory]:
        """Steps this process holds: its own copy and/or its partner's."""
        found: dict[int, Inventory] = {}
        for step in finished_steps(self.directory):
            manifest = read_manifest(self.directory / str(step)) or {}
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
            return sorted((s for s, who in served.items() if len(who) == self.count), reverse=True)

        return self.peers.reduce("local steps", [self.index, mine], servable)

    def meta(self, step: int) -> dict | None:
        """The run meta saved with a local step, as the first process holding it read it (a process whose
        directory was lost has none of its own); None if no process can read it."""
        manifest = read_manifest(self.directory / str(step)) or {}
        return self.peers.reduce(f"local meta of step {step}", [self.index, manifest.get("meta")],
                                 lambda all_: next((m for _, m in sorted(all_, key=lambda v: v[0]) if m), None))

    @_outside_the_mesh
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, str] | str:
        """(state, loader state, which copies served) for `step`, or the reason it cannot be restored
        here (a string, the same on every process). A collective: every process calls it."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]
        step_dir = self.directory / str(step)
        manifest = read_manifest(step_dir) or {}
        own, own_failure = self._read(step_dir, OWN, manifest, leaves, _place_own)
        held, held_failure = None, ""
        if self.replicas:
            held, held_failure = self._read(step_dir, f"partner-{self.held}.safetensors", manifest, leaves,
                                            self._place_held)
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
            back = []
            for i, (_, leaf) in enumerate(leaves):
                rows = held[i] if held is not None else self._place_held(leaf, lambda _, shape: np.zeros(shape, leaf.dtype))
                returned = _moved(rows, self.rows).addressable_shards
                back.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding,
                                                                     [row.data[0] for row in returned]))
            own = own if own is not None else back
        source = "own copies" if not missing else (
            f"own copies, and the partner's copy for process{'es' * (len(missing) > 1)} {', '.join(map(str, missing))}")
        return jax.tree_util.tree_unflatten(treedef, own), dict(data), source

    def _place_held(self, leaf, data_at) -> jax.Array:
        """The rows of the process whose copy this one keeps, on the partners' line of devices."""
        places, shape = leaf.sharding.devices_indices_map(leaf.shape), leaf.sharding.shard_shape(leaf.shape)
        return _rows(self.partner_rows,
                     lambda device: data_at(_index_key(places[self.owner_of[device]], leaf.shape), shape)[None])

    def _read(self, step_dir: Path, name: str, manifest: dict, leaves: list, place
              ) -> tuple[list[jax.Array] | None, str]:
        """The arrays of one file, placed by place(leaf, data_at), checked against the manifest's CRC-32s
        and the wanted shapes and dtypes; (None, why) when damaged, (None, '') when simply absent."""
        sums = manifest.get("files", {}).get(name)
        if sums is None or not (step_dir / name).is_file():
            return None, ""
        try:
            tensors = safetensors.numpy.load_file(str(step_dir / name))
            if _checksums(tensors) != {k: int(v) for k, v in sums.items()}:
                return None, f"{name} of step {step_dir.name} fails its CRC-32 check"

            def stored(path, leaf):
                def data_at(place, shape):
                    data = tensors[f"{path}@{place}"]
                    if data.shape != shape or data.dtype != leaf.dtype:
                        raise ValueError(f"{path} is {data.dtype}{list(data.shape)}, not {leaf.dtype}{list(shape)}")
                    return data
                return data_at

            return [place(leaf, stored(path, leaf)) for path, leaf in leaves], ""
        except KeyError as err:
            return None, f"{name} of step {step_dir.name} lacks the shard {err}"
        except Exception as err:  # a truncated or garbled file: safetensors raises several types
            return None, f"{name} of step {step_dir.name} does not read ({type(err).__name__}: {str(err)[:120]})"

    def set_aside(self, step: int) -> None:
        """Rename this process's copy of a damaged step out of sight, keeping its files for inspection."""
        source = self.directory / str(step)
        if source.is_dir():
            os.rename(source, self.directory / f"corrupt-{step}-{time.strftime('%Y%m%dT%H%M%S')}")


def _place_own(leaf, data_at) -> jax.Array:
    """`leaf` as the run shards it, with this process's shards from data_at(place, shard shape)."""
    places, shape = leaf.sharding.devices_indices_map(leaf.shape), leaf.sharding.shard_shape(leaf.shape)
    pieces = [jax.device_put(data_at(_index_key(places[d], leaf.shape), shape), d) for d in leaf.sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces)


def _rows(sharding: NamedSharding, row_on) -> jax.Array:
    """An array of rows, one per device of a line of devices, from this process's rows (row_on(device),
    each of shape [1, ...])."""
    pieces = [jax.device_put(row_on(device), device) for device in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays((sharding.mesh.devices.size, *pieces[0].shape[1:]), sharding,
                                                    pieces)


def _moved(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`array` on the same devices in another order (onto or back from the partners' line): jax moves the
    rows with a compiled reshard."""
    return jax.device_put(array, sharding)
