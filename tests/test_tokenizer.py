"""One tokenizer interface over four kinds: trained BPE, HF tokenizer.json, Llama 3 tiktoken, sentencepiece.

Every tokenizer file here is built in the test (no downloads): a trained BPE, a tiny tiktoken rank
file, a tiny sentencepiece model and small tokenizer.json files.
"""

import base64
import hashlib
import io
import json

import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from llama_jax.data.corpus import DataError
from llama_jax.data.tokenizer import BOS, EOS, Tokenizer, check_vocab, load_tokenizer, train_bpe

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café",
    "日本語 中文 and 🦙 too",
    "seven wizards quietly hex jolly bards",
    "the end of the text",
] * 8
ROUND_TRIP = [
    "the quick brown fox",
    "café naïve é",
    "中文 日本語",
    "emoji 🦙🔥👩‍👩‍👧",
    "  two  spaces\tand\nlines\n",
    "",
]
MERGES = [b"th", b"the", b" the"]  # ranks 256, 257, 258 after the 256 single bytes


def write_hf(path, specials, config=None):
    """A small byte-level BPE tokenizer.json with these special tokens (ids 0..), and optionally a config."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        SENTENCES,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    hf.save(str(path))
    if config is not None:
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def write_tiktoken(path, tokens=None):
    """A tiktoken rank file: all 256 single bytes as ranks 0..255, then `tokens`, one "<base64> <rank>" a line."""
    tokens = [bytes([b]) for b in range(256)] + (MERGES if tokens is None else tokens)
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


def write_spm(path, **options):
    """A tiny sentencepiece BPE with byte fallback and no normalization, so any text round-trips exactly."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
        minloglevel=2,
        **options,
    )
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One file of each kind, in its own directory."""
    root = tmp_path_factory.mktemp("kinds")
    for name in ("bpe", "hf", "tiktoken", "spm"):
        (root / name).mkdir()
    train_bpe(SENTENCES, 300).save(root / "bpe")
    return {
        "bpe": root / "bpe" / "tokenizer.json",
        "hf": write_hf(
            root / "hf" / "tokenizer.json", [BOS, EOS, "<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>"}
        ),
        "tiktoken": write_tiktoken(root / "tiktoken" / "tokenizer.model"),
        "spm": write_spm(root / "spm" / "spm.model"),
    }


KINDS = {"bpe": "hf", "hf": "hf", "tiktoken": "tiktoken", "spm": "sentencepiece"}


@pytest.mark.parametrize("name", KINDS)
def test_round_trip_and_encode_documents(files, name):
    """Each kind decodes its own ids back to the text, and wraps documents as [BOS] doc [EOS]."""
    tok = load_tokenizer(files[name])
    assert tok.kind == KINDS[name] and tok.path == files[name]
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(ROUND_TRIP) == [tok.encode(t) for t in ROUND_TRIP]
    assert tok.encode_document("the fox") == [tok.bos_id, *tok.encode("the fox"), tok.eos_id]
    assert tok.decode(tok.encode_document("the fox")) == "the fox"  # specials are skipped
    stream = tok.encode_documents(["a fox", "中文"])
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream, tok.encode_document("a fox") + tok.encode_document("中文"))
    assert tok.encode_documents([]).shape == (0,)


@pytest.mark.parametrize("name", KINDS)
def test_special_token_text_is_plain_text(files, name):
    """Corpus text spelling a special token cannot forge a document boundary."""
    tok = load_tokenizer(files[name])
    for text in (BOS, EOS, "<s>", "</s>"):
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == text


@pytest.mark.parametrize("name", KINDS)
def test_save_to_directory_keeps_bytes_and_fingerprint(files, name, tmp_path):
    """A saved copy has the standard name, the same bytes and loads back with an identical fingerprint."""
    tok = load_tokenizer(files[name])
    saved = tok.save(tmp_path / "out")
    assert saved.name == {"hf": "tokenizer.json", "tiktoken": "tokenizer.model", "sentencepiece": "spm.model"}[tok.kind]
    assert saved.read_bytes() == files[name].read_bytes()
    fingerprint = tok.fingerprint()
    assert fingerprint["sha256"] == hashlib.sha256(files[name].read_bytes()).hexdigest()
    assert load_tokenizer(tmp_path / "out").fingerprint() == fingerprint
    assert set(fingerprint) == {"kind", "sha256", "vocab_size", "bos_id", "eos_id"}


def test_train_bpe_save_load_round_trip(tmp_path):
    """A trained BPE saved to a file path loads back with the same ids and sha256 (the cache relies on it)."""
    tok = Tokenizer.train_bpe(SENTENCES, 300)
    assert (tok.kind, tok.path, tok.vocab_size, tok.bos_id, tok.eos_id) == ("hf", None, 300, 0, 1)
    path = tok.save(tmp_path / "tokenizer-300.json")
    assert path == tmp_path / "tokenizer-300.json" == tok.path
    loaded = Tokenizer.load(path)
    assert loaded.fingerprint() == tok.fingerprint()
    assert loaded.encode("the lazy wizards 🦙") == tok.encode("the lazy wizards 🦙")


def test_tiktoken_llama3_layout(files):
    """Specials follow the ranks in Llama 3's order; merges apply; specials are skipped in decode."""
    tok = load_tokenizer(files["tiktoken"])
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (259, 260, 259 + 256)
    assert tok.encode("the the") == [257, 258]
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode(EOS) != [tok.eos_id] and len(tok.encode(EOS)) == len(EOS.encode())
    assert tok.enc.encode("<|eot_id|>", allowed_special="all") == [259 + 9]
    assert tok.decode([tok.bos_id, 257, 259 + 255, tok.eos_id]) == "the"


def test_tiktoken_large_vocab_streams_as_uint32(tmp_path):
    """Past 65,536 ids a uint16 stream would wrap, so encode_documents switches to uint32."""
    extra = [i.to_bytes(2, "big") + b"\xff" for i in range(65536 - 256)]  # distinct 3-byte tokens
    tok = load_tokenizer(write_tiktoken(tmp_path / "tokenizer.model", extra))
    assert (tok.eos_id, tok.vocab_size) == (65537, 65792)
    stream = tok.encode_documents(["hi"])
    assert stream.dtype == np.uint32
    np.testing.assert_array_equal(stream, [65536, ord("h"), ord("i"), 65537])


@pytest.mark.parametrize(
    "config, bos, eos",
    [
        ({"bos_token": "<s>", "eos_token": "</s>"}, 2, 3),
        ({"bos_token": {"content": "<s>", "special": True}, "eos_token": {"content": "</s>"}}, 2, 3),
        ({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, None, 3),
        (None, 0, 1),  # no config: the Llama 3 names win among the known specials
    ],
)
def test_hf_specials_from_config_or_known_names(tmp_path, config, bos, eos):
    tok = load_tokenizer(write_hf(tmp_path / "tokenizer.json", [BOS, EOS, "<s>", "</s>"], config))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (bos, eos, 300)
    assert tok.encode_document("x") == ([bos] if bos is not None else []) + tok.encode("x") + [eos]
    if config is not None:  # the config travels with a saved copy, so it reloads with the same specials
        assert load_tokenizer(tok.save(tmp_path / "copy")).fingerprint() == tok.fingerprint()


def test_no_bos_documents_end_with_eos_only(tmp_path):
    """A tokenizer without BOS (tokenizer.json, or sentencepiece with bos_id=-1) wraps docs as doc + [EOS]."""
    for tok in (
        load_tokenizer(write_hf(tmp_path / "tokenizer.json", ["</s>"])),
        load_tokenizer(write_spm(tmp_path / "spm.model", bos_id=-1)),
    ):
        assert tok.bos_id is None
        np.testing.assert_array_equal(
            tok.encode_documents(["ab", "c"]), tok.encode("ab") + [tok.eos_id] + tok.encode("c") + [tok.eos_id]
        )


def test_directory_spec_picks_the_file(files, tmp_path):
    """tokenizer.json beats tokenizer.model; a lone *.model is found; the kind comes from the content."""
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.json").write_bytes(files["hf"].read_bytes())
    (both / "tokenizer.model").write_bytes(files["tiktoken"].read_bytes())
    assert load_tokenizer(both).path == both / "tokenizer.json"
    (both / "tokenizer.json").unlink()
    assert load_tokenizer(str(both)).kind == "tiktoken"
    llama2 = tmp_path / "llama2"  # a sentencepiece proto under the Llama 3 file name
    llama2.mkdir()
    (llama2 / "tokenizer.model").write_bytes(files["spm"].read_bytes())
    assert load_tokenizer(llama2).kind == "sentencepiece"
    assert load_tokenizer(files["spm"].parent).path == files["spm"]


def one_line_error(spec, *fragments):
    with pytest.raises(DataError) as caught:
        load_tokenizer(spec)
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_bad_inputs_raise_one_line_data_errors(tmp_path):
    one_line_error(tmp_path / "missing.json", "missing.json", "does not exist")
    one_line_error(tmp_path, str(tmp_path), "no single tokenizer file")  # empty directory
    (tmp_path / "empty.json").write_bytes(b"")
    one_line_error(tmp_path / "empty.json", "empty.json", "is empty")
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\xff\xfe garbage \x01" * 20)
    one_line_error(tmp_path / "tokenizer.model", "tokenizer.model", "not a tokenizer.json")
    (tmp_path / "broken.json").write_text('{"model": ')
    one_line_error(tmp_path / "broken.json", "broken.json", "not a valid tokenizer.json")
    one_line_error(write_hf(tmp_path / "tokenizer.json", ["<s>"]), "tokenizer.json", "no end-of-text token")
    one_line_error(write_spm(tmp_path / "noeos.model", eos_id=-1), "noeos.model", "no end-of-sentence token")
    damaged = write_tiktoken(tmp_path / "damaged.model")
    damaged.write_bytes(damaged.read_bytes() + b"not base64 at all\n")
    one_line_error(damaged, "damaged.model", "line 260")
    (tmp_path / "gap.model").write_bytes(b"YQ== 0\nYg== 5\n")
    one_line_error(tmp_path / "gap.model", "gap.model", "ranks must be 0..N-1")
    (tmp_path / "cfg").mkdir()
    write_hf(tmp_path / "cfg" / "tokenizer.json", [BOS, EOS], {"eos_token": "</s>"})
    one_line_error(tmp_path / "cfg", "eos_token '</s>'", "not in the vocabulary")


def test_check_vocab_names_both_numbers(files):
    tok = load_tokenizer(files["tiktoken"])
    check_vocab(tok, 515)
    with pytest.raises(DataError) as caught:
        check_vocab(tok, 512)
    assert str(caught.value) == (
        "the tokenizer has 515 tokens but model.vocab_size is 512; raise model.vocab_size to at least 515"
    )
