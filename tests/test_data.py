"""The simple data path: corpus reading, byte-level BPE, the token cache, packing and batches."""

import numpy as np
import pytest

from llama_jax.config import DataConfig
from llama_jax.data.corpus import DataError, path_documents, shakespeare_documents
from llama_jax.data.loader import PackedBatches, pack_rows, prepare
from llama_jax.data.tokenizer import Tokenizer

VOCAB = 300
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bards".split()


def make_documents(n=30, seed=0):
    """n distinct multi-line documents of English-like words."""
    rng = np.random.default_rng(seed)
    return [f"Document {i}: " + " ".join(rng.choice(WORDS, 12 + i % 7)) + ".\nSecond line, ending here."
            for i in range(n)]


def write_corpus(path, documents):
    path.write_text("\n\n".join(documents) + "\n")
    return path


def split_documents(stream, tokenizer):
    """A BOS..EOS token stream -> the decoded documents, checking every one is wrapped."""
    stream = np.asarray(stream)
    starts = np.flatnonzero(stream == tokenizer.bos_id)
    pieces = np.split(stream, starts[1:])
    assert starts[0] == 0 and all(p[-1] == tokenizer.eos_id for p in pieces)
    return [tokenizer.decode(p) for p in pieces]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train_bpe(make_documents(), VOCAB)


# --------------------------------------------------------------------------------------------
# Corpus


def test_text_file_splits_into_paragraphs(tmp_path):
    """A text file yields one document per blank-line-separated paragraph, stripped, blanks dropped."""
    path = tmp_path / "c.txt"
    path.write_text("First para\nline two\n\n\n  Second para  \n \n\nThird\n\n\n")
    assert path_documents(path) == ["First para\nline two", "Second para", "Third"]


def test_directory_yields_one_document_per_text_file(tmp_path):
    """A directory yields one document per .txt/.md file (nested too); other files are ignored."""
    (tmp_path / "a.txt").write_text("alpha\n\nstill alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# beta")
    (tmp_path / "c.py").write_text("print('not text')")
    (tmp_path / "d.txt").write_text("   \n")  # empty documents are dropped
    assert sorted(path_documents(tmp_path)) == ["# beta", "alpha\n\nstill alpha"]


def test_missing_path_raises(tmp_path):
    """A corpus path that does not exist is a DataError naming the path and what is accepted."""
    with pytest.raises(DataError, match=r"nowhere.*does not exist.*shakespeare"):
        path_documents(tmp_path / "nowhere")


def test_single_document_raises(tmp_path):
    """Fewer than two documents cannot make a train and a validation split."""
    path = tmp_path / "one.txt"
    path.write_text("only one paragraph\n")
    with pytest.raises(DataError, match="1 non-empty document.*at least 2"):
        path_documents(path)


def test_non_utf8_raises(tmp_path):
    """A file that is not UTF-8 is a DataError naming the file, not a UnicodeDecodeError."""
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1 \xff\xfe")
    with pytest.raises(DataError, match=r"bad\.txt is not UTF-8"):
        path_documents(tmp_path)


def test_shakespeare_is_bundled():
    """The embedded default corpus is on disk and splits into hundreds of scene documents."""
    documents = shakespeare_documents()
    assert len(documents) > 500
    assert all(documents)


# --------------------------------------------------------------------------------------------
# Tokenizer


def test_train_bpe_has_specials_and_requested_vocab(tokenizer):
    """The BPE has the requested vocab size, learned merges, and distinct <|begin_of_text|> / <|end_of_text|> ids."""
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert len(tokenizer.encode("the quick brown fox")) < len(b"the quick brown fox")  # merges were learned


@pytest.mark.parametrize("text", [
    "the quick brown fox",
    "  leading spaces, trailing tabs\t\t\n\nand blank lines\n",
    "accents: café, naïve, Ångström, jalapeño",
    "emoji 🦙🔥👩‍👩‍👧 and CJK 日本語 and RTL שלום",
    "control \x00\x01 bytes and math ∑∫√",
    "",
])
def test_round_trip_any_utf8(tokenizer, text):
    """Byte-level BPE: any UTF-8 text encodes without unknowns and decodes back exactly."""
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_encode_documents_wraps_each_in_bos_eos(tokenizer):
    """encode_documents gives one stream [BOS doc EOS BOS doc EOS ...] that splits back into the docs."""
    documents = ["first document", "second 🦙", "third\n\nwith a blank line"]
    stream = tokenizer.encode_documents(documents)
    assert stream[0] == tokenizer.bos_id and stream[-1] == tokenizer.eos_id
    assert (stream == tokenizer.bos_id).sum() == (stream == tokenizer.eos_id).sum() == 3
    expected = np.concatenate([[tokenizer.bos_id, *tokenizer.encode(d), tokenizer.eos_id] for d in documents])
    np.testing.assert_array_equal(stream, expected)
    assert split_documents(stream, tokenizer) == documents


def test_save_load_round_trip(tokenizer, tmp_path):
    """A saved tokenizer loads back with the same ids for the same text."""
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = Tokenizer.load(path)
    text = "Document 3: jolly wizards 🦙"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (tokenizer.vocab_size, tokenizer.bos_id,
                                                                   tokenizer.eos_id)


# --------------------------------------------------------------------------------------------
# prepare: the token cache


def data_config(tmp_path, corpus, every=5):
    return DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache"), val_every_nth_doc=every)


def test_prepare_writes_cache_and_reuses_it(tmp_path, monkeypatch):
    """The first prepare writes tokenizer/train/val files; the second reuses them without retraining."""
    corpus = write_corpus(tmp_path / "c.txt", make_documents())
    messages = []
    first = prepare(data_config(tmp_path, corpus), VOCAB, log=messages.append)
    assert first.directory.parent == tmp_path / "cache"
    names = {p.name for p in first.directory.iterdir()}
    assert {f"tokenizer-{VOCAB}.json", f"train-{VOCAB}.npy", f"val-{VOCAB}.npy"} <= names
    assert len(messages) == 1

    def no_retraining(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again instead of loaded from the cache")
    monkeypatch.setattr(Tokenizer, "train_bpe", no_retraining)
    second = prepare(data_config(tmp_path, corpus), VOCAB, log=messages.append)
    assert len(messages) == 1
    assert second.directory == first.directory
    np.testing.assert_array_equal(second.train_tokens, first.train_tokens)
    np.testing.assert_array_equal(second.val_tokens, first.val_tokens)
    assert second.tokenizer.encode("jolly bards") == first.tokenizer.encode("jolly bards")


def test_validation_is_every_nth_document(tmp_path):
    """Validation holds documents n-1, 2n-1, ...; train holds all the others; the two are disjoint."""
    documents = make_documents(23)
    corpus = write_corpus(tmp_path / "c.txt", documents)
    prepared = prepare(data_config(tmp_path, corpus, every=5), VOCAB, log=lambda _: None)
    val = split_documents(prepared.val_tokens, prepared.tokenizer)
    train = split_documents(prepared.train_tokens, prepared.tokenizer)
    assert val == [documents[i] for i in (4, 9, 14, 19)]
    assert train == [d for i, d in enumerate(documents) if i % 5 != 4]
    assert not set(val) & set(train)


def test_changed_corpus_gets_a_new_cache(tmp_path):
    """Editing the corpus text changes the cache directory, so stale tokens are never reused."""
    documents = make_documents()
    corpus = write_corpus(tmp_path / "c.txt", documents)
    before = prepare(data_config(tmp_path, corpus), VOCAB, log=lambda _: None)
    write_corpus(corpus, documents[:-1] + [documents[-1] + " One more word."])
    after = prepare(data_config(tmp_path, corpus), VOCAB, log=lambda _: None)
    assert after.directory != before.directory
    assert before.directory.exists() and after.directory.exists()
    assert len(after.train_tokens) + len(after.val_tokens) > len(before.train_tokens) + len(before.val_tokens)


def test_too_few_documents_for_a_validation_split_raises(tmp_path):
    """With fewer documents than val_every_nth_doc nothing would be held out: a DataError says what to lower."""
    corpus = write_corpus(tmp_path / "c.txt", make_documents(4))
    with pytest.raises(DataError, match=r"4 documents.*lower data.val_every_nth_doc to at most 4"):
        prepare(data_config(tmp_path, corpus, every=20), VOCAB, log=lambda _: None)
    assert not list((tmp_path / "cache").rglob("*.npy"))  # nothing that looks like a finished cache


def test_vocab_below_byte_alphabet_raises(tmp_path):
    """A model vocab smaller than the byte-level tokenizer (256 bytes + 2 specials) is a DataError naming both."""
    corpus = write_corpus(tmp_path / "c.txt", make_documents())
    with pytest.raises(DataError, match=r"tokenizer has 258 tokens but model.vocab_size is 100"):
        prepare(data_config(tmp_path, corpus), 100, log=lambda _: None)


# --------------------------------------------------------------------------------------------
# Packing and batches

BOS, EOS = 1, 2


def test_pack_rows_hand_made():
    """Targets are tokens shifted by one; segments and positions restart at BOS; the cross-document target is masked."""
    row = [BOS, 5, 6, EOS, BOS, 7, 8, 9, EOS, BOS, 4]
    packed = pack_rows(np.array([row]), bos_id=BOS)
    np.testing.assert_array_equal(packed["tokens"][0], row[:-1])
    np.testing.assert_array_equal(packed["targets"][0], row[1:])
    np.testing.assert_array_equal(packed["positions"][0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(packed["loss_mask"][0], [1, 1, 1, 0, 1, 1, 1, 1, 0, 1])
    segments = packed["segment_ids"][0]
    assert len(set(segments[:4])) == len(set(segments[4:9])) == 1
    assert len({segments[0], segments[4], segments[9]}) == 3


def test_pack_rows_properties():
    """On random rows: segment ids change exactly at BOS, positions restart at 0 at BOS, mask is 0 exactly before a BOS."""
    rng = np.random.default_rng(0)
    rows = rng.integers(3, 50, (6, 41))
    rows[rng.random(rows.shape) < 0.1] = BOS
    rows[1, 0] = BOS
    packed = pack_rows(rows, bos_id=BOS)
    tokens, segments, positions = packed["tokens"], packed["segment_ids"], packed["positions"]
    assert tokens.shape == packed["targets"].shape == segments.shape == positions.shape == (6, 40)
    np.testing.assert_array_equal(packed["targets"], rows[:, 1:])
    np.testing.assert_array_equal(segments[:, 1:] != segments[:, :-1], tokens[:, 1:] == BOS)
    assert (positions[tokens == BOS] == 0).all() and (positions[:, 0] == 0).all()
    continuing = (tokens[:, 1:] != BOS)
    np.testing.assert_array_equal(positions[:, 1:][continuing], positions[:, :-1][continuing] + 1)
    np.testing.assert_array_equal(packed["loss_mask"] == 0, packed["targets"] == BOS)


def numbered_stream(n_rows, seq_len, extra=5):
    """A token stream whose values are their own index + 10: every row is identifiable. No BOS in it."""
    return (np.arange(n_rows * (seq_len + 1) + extra) + 10).astype(np.int32)


def test_batches_are_deterministic():
    """batch(i) is a pure function of (seed, i): same on a fresh object, in any order; other seeds differ."""
    stream = numbered_stream(24, 7)
    a = PackedBatches(stream, 4, 7, seed=3, bos_id=BOS, split="train")
    b = PackedBatches(stream, 4, 7, seed=3, bos_id=BOS, split="train")
    c = PackedBatches(stream, 4, 7, seed=4, bos_id=BOS, split="train")
    late = b.batch(13)  # a later epoch first: the order of calls must not matter
    for step in (0, 1, 5, 13):
        for key, value in a.batch(step).items():
            np.testing.assert_array_equal(value, b.batch(step)[key])
    np.testing.assert_array_equal(late["tokens"], a.batch(13)["tokens"])
    assert any(not np.array_equal(a.batch(s)["tokens"], c.batch(s)["tokens"]) for s in range(6))


def test_epoch_uses_every_row_once():
    """Over one epoch (n_rows / batch_size batches) every row of seq_len+1 tokens is used exactly once."""
    n_rows, batch_size, seq_len = 24, 4, 7
    stream = numbered_stream(n_rows, seq_len)
    batches = PackedBatches(stream, batch_size, seq_len, seed=0, bos_id=BOS, split="train")
    assert batches.n_rows == n_rows
    starts = []
    for step in range(n_rows // batch_size):
        batch = batches.batch(step)
        tokens, targets = batch["tokens"], batch["targets"]
        assert tokens.shape == (batch_size, seq_len)
        for row_tokens, row_targets in zip(tokens, targets):
            row = np.append(row_tokens, row_targets[-1])
            np.testing.assert_array_equal(row, stream[row[0] - 10:row[0] - 10 + seq_len + 1])
            starts.append(int(row[0]) - 10)
    assert sorted(starts) == [i * (seq_len + 1) for i in range(n_rows)]
    assert starts != sorted(starts)  # shuffled, not in stream order
    second_epoch = [int(r[0]) - 10 for s in range(6, 12) for r in batches.batch(s)["tokens"]]
    assert sorted(second_epoch) == sorted(starts)


def test_too_short_stream_raises():
    """A split with fewer tokens than one batch of batch_size x (seq_len + 1) is a DataError naming the split."""
    stream = numbered_stream(3, 7)  # 3 rows, batch of 4 needed
    with pytest.raises(DataError, match=r"validation split has 29 tokens.*4 x 8"):
        PackedBatches(stream, 4, 7, seed=0, bos_id=BOS, split="validation")
