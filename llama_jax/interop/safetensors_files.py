"""Safetensors files as Hugging Face writes them: one <stem>.safetensors, or shards of at most a size with
<stem>.safetensors.index.json naming the file of each tensor. Read a slice of a tensor at a time (SafetensorsReader),
and write tensors streamed a block at a time (write_safetensors: the header is computed from the shapes first; the
safetensors library only writes a whole dict at once). No model here: hf.py maps Llama's tensors onto these files,
peft_format.py an adapter's.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from llama_jax.errors import ConfigError

SHARD_BYTES = 5 * 2**30  # transformers' default shard size

# A tensor to write: (name, shape, blocks), blocks() yielding its rows in blocks on process 0 (None elsewhere).
Item = tuple[str, tuple[int, ...], Callable[[], Iterator[np.ndarray | None]]]


class SafetensorsReader:
    """Slices of tensors by name from model.safetensors or the shards of model.safetensors.index.json.

    An open file is memory-mapped, and every page read through the mapping counts as this process's
    memory until the file is closed; a slice of a few columns touches a page of every row. So each read
    opens the file for at most READ_BYTES of whole rows at a time and closes it again."""

    READ_BYTES = 16 * 2**20

    def __init__(self, directory: Path, stem: str = "model"):
        directory = Path(directory)
        index = directory / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (directory / f"{stem}.safetensors").is_file():
            weight_map = None
        else:
            raise ConfigError(f"{directory} has neither {stem}.safetensors nor {stem}.safetensors.index.json")
        self.files, self.shapes, self.row_bytes, self.dtypes = {}, {}, {}, {}
        for file in sorted(set(weight_map.values())) if weight_map else [f"{stem}.safetensors"]:
            with safe_open(str(directory / file), framework="numpy") as handle:
                for name in handle.keys():
                    if weight_map is None or weight_map.get(name) == file:
                        tensor = handle.get_slice(name)
                        self.files[name], self.shapes[name] = directory / file, tuple(tensor.get_shape())
                        self.dtypes[name] = tensor.get_dtype()  # safetensors' name: F32, BF16, ...
                        itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(tensor.get_dtype(), 4)
                        self.row_bytes[name] = math.prod(self.shapes[name][1:]) * itemsize

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] (slices with start and stop) as numpy, in its stored dtype (bfloat16 via ml_dtypes)."""
        rows, rest = index[0], index[1:]
        step = max(1, self.READ_BYTES // max(1, self.row_bytes[name]))
        if rows.stop - rows.start <= step:
            return self._read(name, index)
        out = None
        for start in range(rows.start, rows.stop, step):
            part = self._read(name, (slice(start, min(start + step, rows.stop)), *rest))
            if out is None:
                out = np.empty((rows.stop - rows.start, *part.shape[1:]), part.dtype)
            out[start - rows.start : start - rows.start + len(part)] = part
        return out

    def _read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return safe_open(str(self.files[name]), framework="numpy").get_slice(name)[index]


def write_safetensors(
    directory: Path, items: list[Item], dtype, shard_bytes: int = SHARD_BYTES, stem: str = "model"
) -> list[str]:
    """Write tensors as safetensors files of at most shard_bytes (one file if it fits: <stem>.safetensors),
    streaming each tensor's blocks; with several files, also <stem>.safetensors.index.json. Only process
    0 writes (the others pull with it). Returns the file names."""
    dtype = np.dtype(dtype)
    code = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(dtype, "BF16")
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, _ in items]
    groups, current, used = [], [], 0
    for item, size in zip(items, sizes):
        if current and used + size > shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append((item, size))
        used += size
    groups.append(current)
    names = (
        [f"{stem}.safetensors"]
        if len(groups) == 1
        else [f"{stem}-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    primary = jax.process_index() == 0
    weight_map = {}
    for name, group in zip(names, groups):
        header, offset = {}, 0
        for (tensor_name, shape, _), size in group:
            header[tensor_name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor_name] = name
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with open(directory / name, "wb") if primary else nullcontext() as f:
            if f is not None:
                f.write(struct.pack("<Q", len(encoded)))
                f.write(encoded)
            for (tensor_name, _, blocks), size in group:
                written = 0
                for block in blocks():
                    if f is not None:
                        f.write(block.reshape(-1).view(np.uint8).data)
                        written += block.nbytes
                if f is not None and written != size:
                    raise RuntimeError(f"{tensor_name}: wrote {written} bytes, its header says {size}")
    if len(names) > 1 and primary:
        (directory / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2) + "\n"
        )
    return names
