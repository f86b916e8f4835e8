"""Packing plans: how one epoch of a component's documents is cut into rows, computed from the document lengths
alone, once, and read back a row at a time.

Per (documents, seed, component, epoch, packing settings) the documents are shuffled and cut into rows of
row_len = seq_len + 1 tokens, either

  concat     concatenated and split every row_len tokens (no padding but the epoch's last row), or
  first_fit  first-fit-decreasing within windows of `data.packing_window` documents: a document starts a row
             more often (longer contexts stay whole), at the cost of some padding,

each with room for a learned prompt in front of every piece (peft: prompt_tokens slots, loader.py).

Host memory does not grow with the corpus. The shuffle is a keyed pseudo-random permutation evaluated in blocks
(Shuffle: a Feistel network, nothing stored per document); a plan is computed a block of documents at a time
and, given a directory, written there once -- the first process to get there computes it under a file lock, the
others wait and read it -- and every process memory-maps it: a row's pieces are read from disk as they are needed.
While a plan is computed the documents' lengths are in memory (4 bytes a document), and nothing else that grows
with the corpus; afterwards nothing at all. Megatron memory-maps its sample and shuffle indices the same way.

A plan is four arrays: row_ptr [rows + 1] (int64) and, per piece, doc, offset and length (int32): row r is
pieces row_ptr[r]:row_ptr[r + 1], in order.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llama_jax.files import advise

PACKINGS = ("concat", "first_fit")
PLAN_VERSION = 2  # in the batch stream's fingerprint: a plan computed otherwise gives other batches
BLOCK_DOCS = 1 << 20  # documents per block of a plan's computation: bounds its temporary memory
ROUNDS = 4  # Feistel rounds: four make a strong pseudo-random permutation of a good round function (Luby-Rackoff)
PIECE_FIELDS = ("doc", "offset", "length")


@dataclass(frozen=True)
class Plan:
    """Rows of one epoch as pieces: row r is pieces row_ptr[r]:row_ptr[r+1], in order."""

    row_ptr: np.ndarray  # int64 [rows + 1]
    doc: np.ndarray  # int32 [pieces] document id
    offset: np.ndarray  # int32 [pieces] first token within the document
    length: np.ndarray  # int32 [pieces]

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1


class Shuffle:
    """A keyed pseudo-random permutation of range(n), evaluated for any block of positions without storing it: a
    Feistel network over the smallest even number of bits that covers n, whose outputs beyond n are encrypted
    again until they fall inside (cycle walking keeps it a permutation of range(n))."""

    def __init__(self, n: int, key: list[int]):
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + bits % 2) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(key).integers(0, 2**63, size=ROUNDS, dtype=np.uint64)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        """The documents at positions start..stop-1 of the shuffled order (int64)."""
        out = self._encrypt(np.arange(start, stop, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right + key) & self.mask)
        return (left << half) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every output bit depends on every input bit (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# --------------------------------------------------------------------------------------------
# The packings, one block of documents at a time


def concat_plan(
    lengths: np.ndarray, order: np.ndarray, row_len: int, start: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Documents in `order`, concatenated after `start` tokens already placed, cut every row_len tokens
    (vectorised: O(documents)). Returns (doc, offset, length, starts_row) per piece; starts_row marks the
    pieces that begin a row."""
    ends = start + np.cumsum(lengths[order], dtype=np.int64)
    starts = ends - lengths[order]
    first_row, end = -(-start // row_len), int(ends[-1])
    boundaries = np.arange(first_row * row_len, end, row_len, dtype=np.int64)
    points = np.union1d(starts, boundaries)  # every piece begins at one
    index = np.searchsorted(ends, points, side="right")  # the document each piece lies in
    return (order[index], points - starts[index], np.diff(np.append(points, end)), points % row_len == 0)


def first_fit_plan(
    lengths: np.ndarray, order: np.ndarray, row_len: int, window: int, rng: np.random.Generator, prompt_tokens: int = 0
) -> Plan:
    """First-fit decreasing within windows of documents; longer documents are cut into full rows first.
    Every piece takes prompt_tokens slots more than its tokens."""
    rows: list[list[tuple[int, int, int]]] = []
    capacity = row_len - prompt_tokens  # the tokens of a piece alone in a row
    for w in range(0, len(order), window):
        window_rows: list[list[tuple[int, int, int]]] = []
        rest: list[tuple[int, int, int]] = []
        for doc in order[w : w + window]:
            full, tail = divmod(int(lengths[doc]), capacity)
            window_rows += [[(int(doc), k * capacity, capacity)] for k in range(full)]
            if tail:
                rest.append((int(doc), full * capacity, tail))
        rest.sort(key=lambda piece: -piece[2])  # stable: ties keep the shuffled order
        space = np.zeros(len(rest), np.int64)
        bins: list[list[tuple[int, int, int]]] = []
        for piece in rest:
            fits = np.flatnonzero(space[: len(bins)] >= piece[2] + prompt_tokens)
            if len(fits):
                bins[fits[0]].append(piece)
                space[fits[0]] -= piece[2] + prompt_tokens
            else:
                bins.append([piece])
                space[len(bins) - 1] = capacity - piece[2]
        window_rows += bins
        rows += [window_rows[i] for i in rng.permutation(len(window_rows))]  # long docs not all first
    return _plan_of_rows(rows)


class PromptedConcat:
    """concat with prompt_tokens slots in front of every piece: documents run on from row to row, each piece with
    its own slots; a row without room for the slots and two tokens (one predicted) ends in padding. Kept across
    blocks: the room left in the current row."""

    def __init__(self, row_len: int, prompt_tokens: int):
        self.row_len, self.prompt_tokens, self.free = row_len, prompt_tokens, 0

    def __call__(self, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, ...]:
        pieces, starts_row = [], []
        for doc in order:
            done, total = 0, int(lengths[doc])
            while done < total:
                new_row = self.free < self.prompt_tokens + 2
                if new_row:
                    self.free = self.row_len
                take = min(total - done, self.free - self.prompt_tokens)
                pieces.append((int(doc), done, take))
                starts_row.append(new_row)
                done, self.free = done + take, self.free - self.prompt_tokens - take
        doc, offset, length = (np.array([p[i] for p in pieces], np.int64) for i in range(3))
        return doc, offset, length, np.array(starts_row, bool)


def _plan_of_rows(rows: list[list[tuple[int, int, int]]]) -> Plan:
    pieces = [p for row in rows for p in row]
    row_ptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    doc, offset, length = (np.array([p[i] for p in pieces], np.int32) for i in range(3))
    return Plan(row_ptr, doc, offset, length)


def pieces_of(
    lengths: np.ndarray, row_len: int, packing: str, window: int, key: list[int], prompt_tokens: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """One epoch's pieces, a block of documents at a time: (doc, offset, length, starts_row) per block."""
    n = len(lengths)
    order_of, rng = Shuffle(n, key), np.random.default_rng(key)  # rng: first_fit's row shuffles
    block = max(window, BLOCK_DOCS // window * window)  # whole windows per block: first_fit works per window
    placed, prompted = 0, PromptedConcat(row_len, prompt_tokens)
    for start in range(0, n, block):
        order = order_of(start, min(n, start + block))
        if packing == "first_fit":
            plan = first_fit_plan(lengths, order, row_len, window, rng, prompt_tokens)
            starts_row = np.zeros(len(plan.doc), bool)
            starts_row[plan.row_ptr[:-1]] = True
            yield plan.doc, plan.offset, plan.length, starts_row
        elif prompt_tokens:
            yield prompted(lengths, order)
        else:
            yield concat_plan(lengths, order, row_len, start=placed)
            placed += int(lengths[order].sum())


# --------------------------------------------------------------------------------------------
# Plans in memory, or on disk and memory-mapped


def compute_plan(
    lengths: np.ndarray, row_len: int, packing: str, window: int, key: list[int], prompt_tokens: int = 0
) -> Plan:
    """One epoch's plan in memory (small corpora, tests)."""
    blocks = list(pieces_of(lengths, row_len, packing, window, key, prompt_tokens))
    doc, offset, length, starts_row = (np.concatenate([b[i] for b in blocks]) for i in range(4))
    row_ptr = np.append(np.flatnonzero(starts_row), len(doc)).astype(np.int64)
    return Plan(row_ptr, doc.astype(np.int32), offset.astype(np.int32), length.astype(np.int32))


def stored_plan(
    directory: Path,
    lengths: Callable[[], np.ndarray],
    row_len: int,
    packing: str,
    window: int,
    key: list[int],
    prompt_tokens: int = 0,
) -> Plan:
    """One epoch's plan, memory-mapped from `directory`: computed and written there first by whichever process
    gets the lock (a block at a time, renamed into place when complete), read by every other."""
    if not (directory / "plan.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with open(directory.parent / f"{directory.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then find the plan written
            if not (directory / "plan.json").is_file():
                _write_plan(directory, lengths(), row_len, packing, window, key, prompt_tokens)
    counts = json.loads((directory / "plan.json").read_text())

    def mapped(name: str, dtype, count: int) -> np.ndarray:
        if not count:
            return np.zeros(0, dtype)
        array = np.memmap(directory / f"{name}.bin", dtype, "r", shape=(count,))
        advise(array, "random")  # a row reads a few entries
        return array

    return Plan(
        mapped("row_ptr", np.int64, counts["rows"] + 1),
        *(mapped(name, np.int32, counts["pieces"]) for name in PIECE_FIELDS),
    )


def _write_plan(
    directory: Path, lengths: np.ndarray, row_len: int, packing: str, window: int, key: list[int], prompt_tokens: int
) -> None:
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {name: open(tmp / f"{name}.bin", "wb") for name in ("row_ptr", *PIECE_FIELDS)}
    pieces = rows = 0
    try:
        for doc, offset, length, starts_row in pieces_of(lengths, row_len, packing, window, key, prompt_tokens):
            for name, values in zip(PIECE_FIELDS, (doc, offset, length)):
                files[name].write(values.astype(np.int32).tobytes())
            files["row_ptr"].write((pieces + np.flatnonzero(starts_row)).astype(np.int64).tobytes())
            pieces, rows = pieces + len(doc), rows + int(starts_row.sum())
        files["row_ptr"].write(np.int64(pieces).tobytes())
    finally:
        for f in files.values():
            f.close()
    (tmp / "plan.json").write_text(json.dumps({"rows": rows, "pieces": pieces, "version": PLAN_VERSION}))
    os.replace(tmp, directory)
