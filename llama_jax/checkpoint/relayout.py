"""A node-local step on another process count or mesh: a run continuing on fewer hosts, or grown back, resumes
from the newest local step whose every saving process's shards the hosts of the run hold between them (their own
copies and partners', in any process directory on them, of any earlier count: local_files.host_pieces), laid out
on the new mesh.

Written here, not with Orbax or TensorStore: those read files that every process can reach, and no other host
can reach a host's /dev/shm or NVMe. Each saved process's shards are read on one process whose host holds them,
become rows on its devices, and one compiled program (a gather of rows, a reshape and a transpose) puts each array
together in the new sharding: XLA's own resharding moves the bytes between hosts over the run's collectives, and
nothing but moves happen, so the state is the saved one bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jax.sharding import NamedSharding

from llama_jax.checkpoint.local import EXCHANGE_BYTES, LocalTier, _batches, _outside_the_mesh
from llama_jax.checkpoint.local_files import checksums, host_pieces, read_manifest
from llama_jax.distributed.peers import Peers


def covered_steps(host_dir: Path, peers: Peers) -> list[list[int]]:
    """[step, process count] of the local steps whose every process's shards some process of this run holds on
    its host (its own or a partner's copy, saved on any process count), newest first: one list for all
    processes. Where a step was saved on two counts (a run that rolled back across a shrink), the larger first."""
    mine = sorted({(step, processes, owner) for step, processes, owner, _, _ in host_pieces(host_dir)})

    def covered(all_: list) -> list[list[int]]:
        owners: dict[tuple[int, int], set[int]] = {}
        for items in all_:
            for step, processes, owner in items:
                owners.setdefault((step, processes), set()).add(owner)
        return [list(key) for key, who in sorted(owners.items(), reverse=True) if who >= set(range(key[1]))]

    return peers.reduce("local steps held by the hosts", [list(item) for item in mine], covered)


def _box(place: str) -> tuple[tuple[int, int], ...]:
    """A shard's place ('0:4,0:8'; a scalar's: '') as (start, stop) per dimension."""
    return tuple((int(a), int(b)) for a, b in (part.split(":") for part in place.split(","))) if place else ()


def _grid(places: list[str], shape: tuple[int, ...]) -> tuple[list[str], tuple[int, ...], tuple[int, ...]] | str:
    """The places of an array's distinct shards in row-major grid order, the grid's shape and a shard's shape;
    or why they do not tile the array as a grid of equal shards (what the reassembly needs)."""
    boxes = {place: _box(place) for place in places}
    cuts = [sorted({box[d] for box in boxes.values()}) for d in range(len(shape))]
    size = tuple(c[0][1] - c[0][0] for c in cuts)
    for d, c in enumerate(cuts):
        if [a for a, _ in c] != list(range(0, shape[d], size[d])) or any(b - a != size[d] for a, b in c):
            return f"its shards of dimension {d} are not equal parts of {shape[d]}"
    grid = tuple(len(c) for c in cuts)
    by_box = {box: place for place, box in boxes.items()}
    order = [by_box.get(tuple(c[i] for c, i in zip(cuts, index))) for index in np.ndindex(*grid)]
    if None in order:
        return "some of its shards are missing"
    return order, grid, size


@_outside_the_mesh
def restore_moved(tier: LocalTier, step: int, processes: int, abstract_state: Any) -> tuple[Any, dict, str] | str:
    """(state, loader state, which copies served) for a local step saved on `processes` processes (or another
    mesh) onto the processes and shardings of `tier`'s run, or why it cannot be (one string for all processes). A
    collective: every process calls it. Which process reads which saved process's shards is chosen alike
    everywhere from what every host reported (the least loaded holder)."""
    pieces = {
        owner: (Path(directory), name)
        for s, count, owner, directory, name in host_pieces(tier.host_dir)
        if s == step and count == processes
    }
    manifests = {where: read_manifest(where) or {} for where, _ in pieces.values()}
    chosen = _providers(tier, step, processes, pieces, manifests)
    if isinstance(chosen, str):
        return chosen
    provider, held_by = chosen
    places = _places(held_by, provider, processes)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]
    plans = _plans(step, leaves, places)
    if isinstance(plans, str):
        return plans
    mine = {owner for owner, q in provider.items() if q == tier.index}
    tensors, failure = _read_mine(mine, pieces, manifests, leaves, plans)
    data = next((manifests[pieces[owner][0]].get("data") for owner in sorted(mine)), None)
    verdicts = tier.peers.reduce(f"moved local step {step}", [tier.index, failure, data], sorted)
    failures = [f"process {q}: {why}" for q, why, _ in verdicts if why]
    if failures:
        return f"local step {step} does not restore ({'; '.join(failures)})"
    data = next((d for _, _, d in verdicts if d), {})
    state = _assembled(tier, leaves, plans, places, tensors)
    readers = sorted({q for q in provider.values()})
    saved = f"{processes} process{'es' * (processes > 1)}"
    return (
        jax.tree_util.tree_unflatten(treedef, state),
        dict(data),
        f"the shards of {saved}, read on process{'es' * (len(readers) > 1)} "
        f"{', '.join(map(str, readers))} of {tier.count}",
    )


def _providers(
    tier: LocalTier, step: int, processes: int, pieces: dict, manifests: dict
) -> tuple[dict[int, int], dict[int, dict[str, list[str]]]] | str:
    """(the process that reads each saved process's shards, what every process reported it holds), from every
    host's report; or why some saved process's shards are on no host of this run (one string for all)."""
    holding = {str(owner): sorted(manifests[where]["files"][name]) for owner, (where, name) in pieces.items()}
    reports = tier.peers.reduce(f"pieces of local step {step}", [tier.index, holding], sorted)
    provider, load = {}, {q: 0 for q, _ in reports}
    for owner in range(processes):  # each saved process's shards are read by the least loaded holder
        holders = [q for q, held in reports if str(owner) in held]
        if not holders:
            return f"local step {step}: no host of this run holds the shards of process {owner} of {processes}"
        provider[owner] = min(holders, key=lambda q: (load[q], q))
        load[provider[owner]] += 1
    return provider, dict(reports)


def _places(held_by: dict, provider: dict[int, int], processes: int) -> dict[str, dict[str, tuple[int, int]]]:
    """Each array's shards by place, each with (the process reading it, the saved process whose shard it is)."""
    places: dict[str, dict[str, tuple[int, int]]] = {}  # array -> place -> (process reading it, saved process)
    for owner in range(processes):
        for key in held_by[provider[owner]][str(owner)]:
            path, _, place = key.rpartition("@")
            places.setdefault(path, {}).setdefault(place, (provider[owner], owner))
    return places


def _plans(step: int, leaves: list, places: dict) -> list | str:
    """Each leaf's grid of shards (_grid), or why one of them cannot be laid out on this mesh."""
    plans = []
    for path, leaf in leaves:
        grid = _grid(list(places.get(path, {})), tuple(leaf.shape)) if path in places else "it is not in the step"
        if isinstance(grid, str):
            return f"local step {step} cannot be laid out on this mesh: {path} ({grid})"
        plans.append(grid)
    return plans


def _read_mine(
    mine: set[int], pieces: dict, manifests: dict, leaves: list, plans: list
) -> tuple[dict[int, dict[str, np.ndarray]], str]:
    """The tensors of the saved processes this process reads, checked against their CRC-32s and the wanted dtypes
    and shard shapes; and what failed, if anything ('' if nothing)."""
    failure = ""
    wanted = {path: (np.dtype(leaf.dtype), size) for (path, leaf), (_, _, size) in zip(leaves, plans)}
    tensors: dict[int, dict[str, np.ndarray]] = {}
    for owner in sorted(mine):
        where, name = pieces[owner]
        try:
            tensors[owner] = safetensors.numpy.load_file(str(where / name))
            if checksums(tensors[owner]) != {k: int(v) for k, v in manifests[where]["files"][name].items()}:
                failure = f"{where / name} fails its CRC-32 check"
            for key, tensor in tensors[owner].items():
                if (want := wanted.get(key.rpartition("@")[0])) and (tensor.dtype, tensor.shape) != want:
                    failure = (
                        f"{key} in {where / name} is {tensor.dtype}{list(tensor.shape)}, not {want[0]}{list(want[1])}"
                    )
        except Exception as err:  # a truncated or garbled file: safetensors raises several types
            failure = f"{where / name} does not read ({type(err).__name__}: {str(err)[:120]})"
    return tensors, failure


def _assembled(tier: LocalTier, leaves: list, plans: list, places: dict, tensors: dict) -> list[jax.Array]:
    """The leaves in the run's shardings, put together from the shards every process read (as rows on the run's
    devices), by one compiled program per batch of leaves."""
    rows = []
    for (path, leaf), (order, _, size) in zip(leaves, plans):
        rows.append(
            _rows_of(tier, leaf.dtype, size, [(places[path][place], f"{path}@{place}") for place in order], tensors)
        )
    state = []  # in batches of EXCHANGE_BYTES per device: XLA may gather an array whole on a device
    whole = [math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for _, leaf in leaves]
    for batch in _batches(list(zip(leaves, plans, rows, whole)), lambda item: item[3], EXCHANGE_BYTES):
        specs = tuple(
            (tuple(row_of), grid, size, tuple(leaf.shape)) for (_, leaf), (_, grid, size), (_, row_of), _ in batch
        )
        assemble = _assembly(specs, tier.rows, tuple(leaf.sharding for (_, leaf), _, _, _ in batch))
        state.extend(assemble(*(array for _, _, (array, _), _ in batch)))
    return state


def _rows_of(
    tier: LocalTier,
    dtype,
    size: tuple[int, ...],
    shards: list[tuple[tuple[int, int], str]],
    tensors: dict[int, dict[str, np.ndarray]],
) -> tuple[jax.Array, list[int]]:
    """An array's shards, in grid order (each: (process reading it, saved process), its key), as rows on the
    run's devices: each process puts those it read on its own devices, k a device. (The rows, and the row
    of each shard.)"""
    slots: dict[int, list[int]] = {}  # process -> the grid positions of the shards it reads
    for position, ((reader, _), _) in enumerate(shards):
        slots.setdefault(reader, []).append(position)
    k = max(math.ceil(len(v) / len(tier.local_devices[q])) for q, v in slots.items())
    row_of = [0] * len(shards)
    for q, positions in slots.items():
        for j, position in enumerate(positions):
            device = tier.local_devices[q][j % len(tier.local_devices[q])]
            row_of[position] = tier.position[device] * k + j // len(tier.local_devices[q])
    mine = {row_of[p]: p for p in slots.get(tier.index, [])}
    pieces = []
    for device in tier.rows.addressable_devices:
        block = np.zeros((k, *size), dtype)
        for j in range(k):
            if (p := mine.get(tier.position[device] * k + j)) is not None:
                (_, owner), key = shards[p]
                block[j] = tensors[owner][key]  # its dtype and shape were checked when read
        pieces.append(jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays((len(tier.devices) * k, *size), tier.rows, pieces), row_of


def _assembly(specs: tuple, rows: NamedSharding, shardings: tuple):
    """A compiled function from arrays of rows (one per array: its shards, by row numbers) to the arrays,
    in `shardings`: each spec is (the rows of the shards in grid order, the grid, a shard's shape, the array's
    shape). A gather of rows, a reshape and a transpose: XLA moves each shard where the sharding wants it."""

    def assemble(*arrays):
        out = []
        for rows_in, (row_of, grid, size, shape) in zip(arrays, specs):
            shards = jnp.take(rows_in, np.asarray(row_of, np.int32), axis=0).reshape(*grid, *size)
            interleaved = [axis for d in range(len(shape)) for axis in (d, len(shape) + d)]
            out.append(shards.transpose(interleaved).reshape(shape))
        return out

    return jax.jit(assemble, in_shardings=tuple(rows for _ in specs), out_shardings=list(shardings))
