"""The node-local tier's files (local.py): where each host and process keeps its steps, what a finished step holds,
the CRC-32s that check it, and its tensors read back checked.

Each process keeps its own directory, ``<checkpoint.local_dir>/<run>/<host>/process-<i>/``, on storage only
its host reads (/dev/shm, a local NVMe). A finished step is a directory ``<step>/`` holding

    own.safetensors        this process's shards of the train state (each distinct shard once)
    partner-<j>.safetensors the shards of process j, sent here with checkpoint.local_replicas=1
    manifest.json          the step, a CRC-32 of every tensor, the loader position and the run's meta

written under a temporary name and renamed when complete, so a step directory that exists is finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

from llama_jax.distributed.processes import node_name

OWN = "own.safetensors"
MANIFEST = "manifest.json"


def host_directory(local_dir: str, run_dir: Path, node: str | None = None) -> Path:
    """What one host holds of the run's local tier: ``<local_dir>/<run>-<hash>/<node>/``. The run's name and a
    hash of its absolute path keep runs that share a local_dir apart; the host's name (processes.node_name(),
    default this one's) keeps hosts apart where a local_dir is shared, as in a simulation of several hosts on
    one machine, so that a host reads only what its own storage would hold."""
    run_dir = Path(run_dir).absolute()
    key = f"{run_dir.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"
    return Path(local_dir).expanduser().absolute() / key / (node or node_name())


def process_directory(local_dir: str, run_dir: Path, process: int, node: str | None = None) -> Path:
    """The directory process `process` writes its local steps to, on host `node` (default this one)."""
    return host_directory(local_dir, run_dir, node) / f"process-{process}"


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


def host_pieces(host_dir: Path) -> list[list]:
    """Every process's shards this host holds, by finished step: [step, process count that saved it, the process
    whose shards they are, the step's directory, the file], from the manifests of every process directory under
    host_dir (its own copies, the partners' copies it keeps, and those of earlier runs on other process counts)."""
    pieces = []
    for directory in sorted(host_dir.glob("process-*")) if host_dir.is_dir() else []:
        for step in finished_steps(directory):
            manifest = read_manifest(directory / str(step)) or {}
            files, processes = manifest.get("files", {}), manifest.get("processes")
            holds = manifest.get("holds")
            for owner, name in ((manifest.get("process"), OWN), (holds, f"partner-{holds}.safetensors")):
                if owner is not None and name in files and isinstance(processes, int):
                    pieces.append([step, processes, owner, str(directory / str(step)), name])
    return pieces


def checksums(tensors: dict[str, np.ndarray]) -> dict[str, int]:
    """CRC-32 of each tensor's bytes, on a thread per core: zlib releases the GIL on large buffers."""

    def crc(t: np.ndarray) -> int:
        return zlib.crc32(np.ascontiguousarray(t).view(np.uint8).reshape(-1))

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(tensors, pool.map(crc, tensors.values())))


def read_arrays(step_dir: Path, name: str, manifest: dict, leaves: list, place) -> tuple[list[jax.Array] | None, str]:
    """The arrays of one file, placed by place(leaf, data_at), checked against the manifest's CRC-32s
    and the wanted shapes and dtypes; (None, why) when damaged, (None, '') when simply absent."""
    sums = manifest.get("files", {}).get(name)
    if sums is None or not (step_dir / name).is_file():
        return None, ""
    try:
        tensors = safetensors.numpy.load_file(str(step_dir / name))
        if checksums(tensors) != {k: int(v) for k, v in sums.items()}:
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
