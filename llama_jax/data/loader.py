"""Batches from token stores, as a pure function of (seed, step, data config).

Per mixture component (one input of one store) and epoch, a *packing plan* (plans.py) cuts the shuffled
documents into rows of seq_len + 1 tokens. Grain mixes the components' rows by weight (an exact, deterministic
interleaving), and global batch i is rows [i·B, (i+1)·B) of the mixture. A process reads only its own rows'
tokens. Because nothing depends on how many processes read or where a previous run stopped, resuming at step i
-- with any number of processes or data-parallel shards -- replays exactly the batches a straight run would have
seen. Grain's threads prepare the next batches while the accelerator works.

Host memory does not grow with the corpus: a store's tokens and document index are memory-mapped, and the
plans are written once and memory-mapped too (plans.py), so a process holds a few numbers per unit of work and
per epoch, whatever the number of documents.

The plan and packing are our own code: Grain's packers are iterators whose output depends on the
iteration history of each process, which is exactly what exact resume across process counts rules out.

Prompt tuning and P-tuning (peft.prompt_tokens = P) put P learned virtual tokens in front of every
document. The loader leaves the room for them: every piece of a row is P slots (token ids -1 ... -P,
at positions 0 ... P-1 of the piece's segment) and then the piece's tokens (positions P, P+1, ...), as
if the prompt were part of the document, and the model fills the slots with the learned embeddings
(model/llama.py). The plan counts the slots, so the batch keeps its static [batch, seq_len] shape, segment
ids and positions stay exact for packed documents with any attention kernel or sequence sharding, and
batches remain a pure function of (seed, step); inserting the slots inside the model instead would
need room for a prompt per document in every row, whatever the number of documents it holds.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from llama_jax.data.plans import PACKINGS, PLAN_VERSION, Plan, compute_plan, stored_plan
from llama_jax.errors import DataError
from llama_jax.files import advise

# --------------------------------------------------------------------------------------------
# Token stores


@dataclass(frozen=True)
class Documents:
    """The documents of one input and split of a store: where each one's tokens are, found through its unit of
    work (a shard of tokens and the memory-mapped boundaries of its documents), nothing kept per document."""

    shards: tuple[np.ndarray, ...]  # memory-mapped token ids, one array per unit
    bounds: tuple[np.ndarray, ...]  # per unit: its documents' boundaries in the shard (n + 1), memory-mapped
    first: np.ndarray  # int64 [units + 1]: the first document of each unit, and the count
    identity: str = ""  # names these documents (store fingerprint, split, input): where their plans are kept

    def read(self, doc: int, offset: int, count: int) -> np.ndarray:
        unit = int(np.searchsorted(self.first, doc, side="right")) - 1
        begin = int(self.bounds[unit][doc - self.first[unit]]) + offset
        return self.shards[unit][begin : begin + count]

    def __len__(self) -> int:
        return int(self.first[-1])

    def lengths(self) -> np.ndarray:
        """Every document's token count (int32, 4 bytes a document): what a plan is computed from."""
        out = np.empty(len(self), np.int32)
        for unit, bounds in enumerate(self.bounds):
            out[self.first[unit] : self.first[unit + 1]] = np.diff(bounds)
            advise(bounds, "done")  # read once, front to back: its pages need not stay in this process
        return out

    @property
    def length(self) -> np.ndarray:
        return self.lengths()

    @property
    def tokens(self) -> int:
        return sum(int(b[-1]) for b in self.bounds)

    @classmethod
    def in_memory(cls, documents: list[np.ndarray]) -> Documents:
        """Documents held in memory (a text file to score), as one unit."""
        bounds = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
        return cls((np.concatenate(documents).astype(np.int32),), (bounds,), np.array([0, len(documents)], np.int64))


class TokenStore:
    """A directory written by `llama-jax prepare` (see prepare.py for the layout)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        meta = self.directory / "meta.json"
        if not meta.exists():
            if (self.directory / ".prepare.json").exists():
                raise DataError(
                    f"{self.directory} is an unfinished token store; re-run the same `llama-jax prepare` "
                    "command to finish it (it resumes)"
                )
            raise DataError(f"{self.directory} is not a token store (no meta.json); make one with `llama-jax prepare`")
        self.meta = json.loads(meta.read_text())
        self.tokenizer_path = self.directory / self.meta["tokenizer"]["file"]
        self.tokenizer_sha256 = self.meta["tokenizer"]["sha256"]  # names the tokenizer it was prepared with

    def documents(self, split: str, source: int) -> Documents:
        units = self.meta["sources"][source]["units"]
        shards, bounds, first = [], [], [0]
        for unit in units:
            index = np.load(self.directory / "shards" / f"{unit:05d}.{split}.idx.npy", mmap_mode="r")
            path = self.directory / "shards" / f"{unit:05d}.{split}.bin"
            expected = int(index[-1]) * np.dtype(self.meta["dtype"]).itemsize
            if path.stat().st_size != expected:
                raise DataError(
                    f"{path} has {path.stat().st_size} bytes, its index says {expected}; "
                    "the store is damaged: prepare it again into a new directory"
                )
            shards.append(np.memmap(path, self.meta["dtype"], "r") if expected else np.zeros(0, self.meta["dtype"]))
            advise(shards[-1], "random"), advise(index, "random")
            bounds.append(index)
            first.append(first[-1] + len(index) - 1)
        return Documents(
            tuple(shards),
            tuple(bounds),
            np.array(first, np.int64),
            identity=f"{self.meta['fingerprint']}/{split}/{source}",
        )


# --------------------------------------------------------------------------------------------
# Rows


class PackedRows:
    """Row k of a component's endless sequence of epochs (a Grain data source: len and getitem).

    An epoch's plan is computed on first use: into `plans` (a directory) once, memory-mapped by every process that
    reads it, or, without one, in memory; the current and the next epoch are kept at hand. A lock makes this safe
    under Grain's reader threads.
    """

    def __init__(
        self,
        documents: Documents,
        row_len: int,
        seed: int,
        salt: int,
        packing: str,
        window: int,
        prompt_tokens: int = 0,
        plans: Path | None = None,
    ):
        if packing not in PACKINGS:
            raise DataError(f"data.packing '{packing}' is unknown; use concat or first_fit")
        self.documents, self.row_len, self.seed, self.salt = documents, row_len, seed, salt
        self.packing, self.window, self.prompt_tokens = packing, window, prompt_tokens
        self.directory = None if plans is None else plans / self._key()
        self._first_row = [0]  # _first_row[e] = global index of epoch e's first row
        self._plans: dict[int, Plan] = {}
        self._lock = threading.Lock()

    def _key(self) -> str:
        """Everything a plan depends on, hashed: its directory under `plans`."""
        identity = [
            self.documents.identity,
            self.seed,
            self.salt,
            self.packing,
            self.window,
            self.row_len,
            self.prompt_tokens,
            PLAN_VERSION,
        ]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]

    def __len__(self) -> int:
        return sys.maxsize  # endless: epochs follow each other

    def plan(self, epoch: int) -> Plan:
        with self._lock:
            while len(self._first_row) <= epoch + 1:  # row counts of earlier epochs are needed first
                e = len(self._first_row) - 1
                self._first_row.append(self._first_row[-1] + self._compute(e).rows)
            return self._compute(epoch)

    def _compute(self, epoch: int) -> Plan:
        if epoch not in self._plans:
            key = [self.seed, self.salt, epoch]
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = (
                compute_plan(self.documents.lengths(), self.row_len, self.packing, self.window, key, self.prompt_tokens)
                if self.directory is None
                else stored_plan(
                    self.directory / f"epoch-{epoch}",
                    self.documents.lengths,
                    self.row_len,
                    self.packing,
                    self.window,
                    key,
                    self.prompt_tokens,
                )
            )
        return self._plans[epoch]

    def rows_in_epoch(self, epoch: int) -> int:
        return self.plan(epoch).rows

    def _locate(self, k: int) -> tuple[Plan, int]:
        # Epochs are counted once, in order, as the rows reach them; then row k's epoch is a bisection of
        # their first rows, so a row never recomputes the plans of earlier epochs (which are not kept).
        with self._lock:
            while self._first_row[-1] <= k:
                self._first_row.append(self._first_row[-1] + self._compute(len(self._first_row) - 1).rows)
        epoch = bisect.bisect_right(self._first_row, k) - 1
        return self.plan(epoch), k - self._first_row[epoch]

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        plan, r = self._locate(k)
        tokens = np.zeros(self.row_len, np.int32)  # padding: token 0, segment 0, never a target
        segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
        at, prompt = 0, -1 - np.arange(self.prompt_tokens, dtype=np.int32)  # the prompt's slots: -1, -2, ...
        for segment, p in enumerate(range(plan.row_ptr[r], plan.row_ptr[r + 1]), start=1):
            n, start = int(plan.length[p]), at
            tokens[at : at + len(prompt)] = prompt
            at += len(prompt)
            tokens[at : at + n] = self.documents.read(int(plan.doc[p]), int(plan.offset[p]), n)
            at += n
            segments[start:at] = segment
            positions[start:at] = np.arange(at - start)
        return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def model_inputs(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows of seq_len + 1 -> inputs and next-token targets of seq_len.

    The loss skips padding and the one target per segment boundary that would ask the model to
    predict the next document from the previous one; and prompt slots, as inputs and as targets: a
    piece's first token is not predicted from its prompt alone, so a prompt-tuned model is scored on
    the tokens the base model is scored on.
    """
    tokens, segments, positions = (np.stack([r[k] for r in rows]) for k in ("tokens", "segment_ids", "positions"))
    text = tokens >= 0  # prompt slots hold negative ids
    same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0) & text[:, :-1] & text[:, 1:]
    return {
        "tokens": tokens[:, :-1],
        "targets": np.maximum(tokens[:, 1:], 0),
        "segment_ids": segments[:, :-1],
        "positions": positions[:, :-1],
        "loss_mask": same.astype(np.float32),
    }


# --------------------------------------------------------------------------------------------
# Batches


class Batches:
    """Global batch i = rows [F + i·B, F + (i+1)·B) of the mixture, F the rows skipped at its start (a stage's
    stream continues where the stages before it stopped: config/stages.py); a process reads only some rows of each."""

    def __init__(
        self, rows: grain.MapDataset, batch_size: int, seq_len: int, components: list[PackedRows], first_row: int = 0
    ):
        self.rows, self.batch_size, self.seq_len, self.components = rows, batch_size, seq_len, components
        self.first_row = first_row

    def batches_per_epoch(self) -> int:
        """Whole batches in the first epoch of every component together."""
        return max(1, sum(c.rows_in_epoch(0) for c in self.components) // self.batch_size)

    def batch(self, step: int, rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Global batch `step`, or only its `rows` (a process's share)."""
        first = self.first_row + step * self.batch_size
        return model_inputs([self.rows[first + i] for i in (range(self.batch_size) if rows is None else rows)])

    def iterate(
        self, start: int, stop: int, rows: Sequence[int] | None = None, threads: int = 2, prefetch: int = 4
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches start..stop-1, prepared ahead by Grain's reader threads."""
        steps = grain.MapDataset.range(start, stop).map(functools.partial(self.batch, rows=rows))
        if threads == 0:
            return iter(steps)
        return iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)))


def mixture(components: list[PackedRows], weights: list[float]) -> grain.MapDataset:
    sources = [grain.MapDataset.source(c) for c in components]
    return sources[0] if len(sources) == 1 else grain.MapDataset.mix(sources, weights)


@dataclass(frozen=True)
class Component:
    store: TokenStore
    source: int  # index into the store's inputs
    weight: float  # share of the mixture (the weights sum to 1)

    @property
    def name(self) -> str:
        return f"{self.store.directory}#{self.store.meta['sources'][self.source]['input']}"


def components(stores: list[TokenStore], weights: list[float]) -> list[Component]:
    """Every input of every store, weighted: store weight (given, or its share of the tokens) times
    the input's weight within the store (given at prepare time, or its share of the store's tokens)."""
    if weights and len(weights) != len(stores):
        raise DataError(f"data.weights has {len(weights)} value(s) for {len(stores)} source(s); give one per source")
    if any(w <= 0 for w in weights):
        raise DataError("data.weights must all be > 0")
    store_weights = weights or [s.meta["tokens"]["train"] for s in stores]
    result = []
    for store, store_weight in zip(stores, store_weights):
        inputs = store.meta["sources"]
        share = [x["weight"] if x["weight"] is not None else x["tokens"]["train"] for x in inputs]
        for i, w in enumerate(share):
            result.append(Component(store, i, store_weight / sum(store_weights) * w / sum(share)))
    return result


def batches(
    parts: list[Component],
    split: str,
    batch_size: int,
    seq_len: int,
    seed: int,
    packing: str,
    window: int,
    prompt_tokens: int = 0,
    plans: Path | None = None,
    first_row: int = 0,
) -> Batches:
    """The batches of `parts` mixed by weight, from row `first_row` of the mixture on; `plans`: the directory the
    packing plans are written to and memory-mapped from (None: in memory)."""
    rows = []
    for salt, part in enumerate(parts):
        documents = part.store.documents(split, part.source)
        if not len(documents):
            raise DataError(f"{part.name} has no {split} documents; prepare it with more documents")
        rows.append(PackedRows(documents, seq_len + 1, seed, salt, packing, window, prompt_tokens, plans))
    tokens = sum(r.documents.tokens for r in rows)
    # Validation may be smaller than a batch (its rows repeat); training on repeats would mislead.
    if split == "train" and tokens < batch_size * (seq_len + 1):
        raise DataError(
            f"the training split has {tokens} tokens, fewer than one batch of {batch_size} x "
            f"{seq_len + 1}; lower train.batch_size or train.seq_len, or use a larger corpus"
        )
    return Batches(mixture(rows, [p.weight for p in parts]), batch_size, seq_len, rows, first_row)


def document_batches(documents: list[np.ndarray], batch_size: int, seq_len: int, prompt_tokens: int = 0) -> Batches:
    """Batches of in-memory token documents (e.g. a text file to score), concatenated and split."""
    docs = Documents.in_memory(documents)
    if docs.tokens < seq_len + 1:
        raise DataError(
            f"the text has {docs.tokens} tokens, fewer than one row of {seq_len + 1}; lower --seq-len or give more text"
        )
    rows = PackedRows(docs, seq_len + 1, seed=0, salt=0, packing="concat", window=1, prompt_tokens=prompt_tokens)
    return Batches(grain.MapDataset.source(rows), batch_size, seq_len, [rows])


def stream_fingerprint(parts: list[Component], **settings) -> str:
    """Names the batch stream: equal fingerprints give equal batches for every step."""
    identity = [[p.store.meta["fingerprint"], p.source, round(p.weight, 12)] for p in parts]
    settings = settings | {"plan": PLAN_VERSION}  # the same settings planned otherwise give other batches
    return hashlib.sha256(json.dumps([identity, settings], sort_keys=True).encode()).hexdigest()[:16]


def log_components(parts: list[Component], print_fn: Callable[[str], None]) -> None:
    if len(parts) > 1:
        print_fn("data mixture: " + ", ".join(f"{p.name} {p.weight:.1%}" for p in parts))
