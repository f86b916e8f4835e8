"""Tokenizers behind one small interface: a Hugging Face `tokenizer.json`, a Llama 3 tiktoken
`tokenizer.model`, or a sentencepiece `.model` — plus a byte-level BPE trained here in seconds.

Every kind keeps the exact bytes of its file: `fingerprint()` hashes them and `save()` writes them
back unchanged, so a cache keyed on the fingerprint stays valid across save/load. `encode` never
turns text like "<|end_of_text|>" into a special token — corpus text must not be able to forge a
document boundary; only `encode_document(s)` adds BOS/EOS.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from llama_jax.errors import DataError
from llama_jax.files import atomic_path, unreadable

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"

# Specials we recognise in a tokenizer.json that has no tokenizer_config.json beside it, in order of preference.
KNOWN_BOS = (BOS, "<s>", "<bos>")
KNOWN_EOS = (EOS, "</s>", "<eos>", "<|endoftext|>")

# Llama 3's pre-tokenizer split (from Meta's reference tokenizer.py); the rank file does not carry it.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    BOS,
    EOS,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]  # 256 in all

# One line of a tiktoken rank file; sniffing the first line tells it apart from a binary sentencepiece proto.
_RANK_LINE = re.compile(rb"([A-Za-z0-9+/]+=*) (\d+)\r?")


def _one_line(error: Exception) -> str:
    """Library errors can span lines; a DataError message must not."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__


class Tokenizer:
    """Base class: the shared document/stream logic. Subclasses implement encode_batch and decode."""

    kind: str
    file_name: str  # the standard name `save` uses when given a directory

    def __init__(self, path: Path | None, data: bytes, vocab_size: int, bos_id: int | None, eos_id: int):
        self.path, self.data = path, data
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_document(self, text: str) -> list[int]:
        return self._wrap(self.encode(text))

    def _wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """Documents -> one stream [BOS doc EOS BOS doc EOS ...]; uint16 when every id fits (half the disk)."""
        dtype = np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        pieces = [np.asarray(self._wrap(ids), dtype=dtype) for ids in self.encode_batch(list(texts))]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype)

    def fingerprint(self) -> dict:
        return {
            "kind": self.kind,
            "sha256": hashlib.sha256(self.data).hexdigest(),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def save(self, target: Path) -> Path:
        """Write the file's exact bytes to `target`: a directory (or a suffix-less path, created) gets the
        standard file name; any other path is used as given. Returns the written path."""
        target = Path(target)
        if target.is_dir() or not target.suffix:
            target.mkdir(parents=True, exist_ok=True)
            target = target / self.file_name
        with atomic_path(target) as tmp:
            tmp.write_bytes(self.data)
        self.path = target
        return target

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        return load_tokenizer(path)


class HFTokenizer(Tokenizer):
    kind, file_name = "hf", "tokenizer.json"

    def __init__(self, path: Path | None, data: bytes, config: bytes | None = None):
        where = path or "the trained tokenizer"
        try:
            self.hf = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the library raises bare Exception for malformed JSON
            raise DataError(
                f"{where} is not a valid tokenizer.json ({_one_line(e)}); re-export it with tokenizers' Tokenizer.save"
            ) from None
        # Without this, specials written in the text are matched as specials, so a corpus could forge BOS/EOS.
        self.hf.encode_special_tokens = True
        self.config = config
        bos, eos = self._specials(where, config)
        if eos is None:
            raise DataError(
                f"{where} has no end-of-text token (looked for {', '.join(KNOWN_EOS)}); add one as a "
                "special token or name it as eos_token in a tokenizer_config.json beside it"
            )
        super().__init__(path, data, self.hf.get_vocab_size(with_added_tokens=True), bos, eos)

    def _specials(self, where, config: bytes | None) -> tuple[int | None, int | None]:
        settings = {}
        if config is not None:
            try:
                settings = json.loads(config)
                assert isinstance(settings, dict)
            except (ValueError, AssertionError):
                raise DataError(
                    f"the tokenizer_config.json beside {where} is not a JSON object; fix or delete it"
                ) from None

        def pick(key: str, known: tuple[str, ...]) -> int | None:
            if key not in settings:  # no config says otherwise: the first known special this vocab has
                return next((i for i in map(self.hf.token_to_id, known) if i is not None), None)
            token = settings[key]
            token = token.get("content") if isinstance(token, dict) else token
            if token is None:
                return None
            if self.hf.token_to_id(token) is None:
                raise DataError(
                    f"tokenizer_config.json beside {where} names {key} {token!r}, which is not in "
                    "the vocabulary; fix the config"
                )
            return self.hf.token_to_id(token)

        bos = pick("bos_token", KNOWN_BOS)
        # add_bos_token=false means documents do not start with BOS; bos_id is None so nothing adds one.
        return (bos if settings.get("add_bos_token", True) else None), pick("eos_token", KNOWN_EOS)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, target: Path) -> Path:
        path = super().save(target)
        if self.config is not None:  # BOS/EOS came from it: a copy without it could pick different ones
            with atomic_path(path.with_name("tokenizer_config.json")) as tmp:
                tmp.write_bytes(self.config)
        return path


class TiktokenTokenizer(Tokenizer):
    """Llama 3's `tokenizer.model`: lines "<base64 token> <rank>"; the 256 specials follow the ranks."""

    kind, file_name = "tiktoken", "tokenizer.model"

    def __init__(self, path: Path, data: bytes):
        # Parsed here rather than by tiktoken.load.load_tiktoken_bpe, which also copies the file into a cache dir.
        ranks: dict[bytes, int] = {}
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            match = _RANK_LINE.fullmatch(line)
            if not match:
                raise DataError(
                    f"{path} line {number} is not '<base64 token> <rank>'; the tiktoken file is "
                    "damaged, download it again"
                )
            try:
                ranks[base64.b64decode(match[1], validate=True)] = int(match[2])
            except binascii.Error:
                raise DataError(
                    f"{path} line {number} has bad base64; the tiktoken file is damaged, download it again"
                ) from None
        n = len(ranks)
        # Specials are numbered from n, so ranks must be exactly 0..n-1; and every byte must have a rank
        # or text containing it could not be encoded.
        if sorted(ranks.values()) != list(range(n)) or any(bytes([b]) not in ranks for b in range(256)):
            raise DataError(
                f"{path} is not a complete tiktoken rank file (ranks must be 0..N-1 and cover all "
                "256 bytes); download it again"
            )
        specials = {name: n + i for i, name in enumerate(LLAMA3_SPECIALS)}
        self.n_ranks = n
        self.enc = tiktoken.Encoding(
            path.stem,
            pat_str=LLAMA3_SPLIT,
            mergeable_ranks=ranks,
            special_tokens=specials,
            explicit_n_vocab=n + len(specials),
        )
        super().__init__(path, data, n + len(specials), specials[BOS], specials[EOS])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary == encode(text, disallowed_special=()): special-token text is encoded as plain text.
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.n_ranks])  # ids >= n are specials


class SentencePieceTokenizer(Tokenizer):
    kind, file_name = "sentencepiece", "spm.model"

    def __init__(self, path: Path, data: bytes):
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except (RuntimeError, OSError, ValueError, TypeError):
            raise DataError(
                f"{path} is not a tokenizer.json, a tiktoken rank file or a sentencepiece model; "
                "point at a valid tokenizer file"
            ) from None
        if self.sp.eos_id() < 0:
            raise DataError(f"{path} has no end-of-sentence token; retrain it with eos_id set")
        bos = self.sp.bos_id()
        super().__init__(path, data, self.sp.get_piece_size(), bos if bos >= 0 else None, self.sp.eos_id())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Control symbols like </s> are never matched in input text by sentencepiece, so no forging here.
        return self.sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])  # sentencepiece drops control ids (BOS/EOS) itself


def _pick_file(directory: Path) -> Path:
    """tokenizer.json first (it carries its own specials), then tokenizer.model, then a lone *.model."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return directory / name
    models_found = sorted(p for p in directory.glob("*.model") if p.is_file())
    if len(models_found) == 1:
        return models_found[0]
    found = ", ".join(p.name for p in models_found) or "none"
    raise DataError(
        f"directory {directory} holds no single tokenizer file (tokenizer.json, tokenizer.model or "
        f"one *.model; found {found}); pass the file path instead"
    )


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Load a tokenizer file, or the tokenizer file in a directory. The kind is read from the content,
    not the name: Llama 2 and Llama 3 both ship a `tokenizer.model`, one protobuf and one text."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if problem := unreadable(path, "directory"):  # before looking inside it
            raise DataError(f"tokenizer {problem}; pass a readable tokenizer file or its directory")
        path = _pick_file(path)
    if not path.is_file():
        raise DataError(
            f"tokenizer {path} does not exist; pass a tokenizer.json, tokenizer.model or "
            "sentencepiece .model file, or a directory holding one"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read tokenizer {path} ({e.strerror}); check that it is readable") from None
    if not data.strip():
        raise DataError(f"tokenizer file {path} is empty; copy the tokenizer file there again")
    if data.lstrip()[:1] == b"{":
        config_path = path.with_name("tokenizer_config.json")
        config = config_path.read_bytes() if config_path.is_file() else None
        return HFTokenizer(path, data, config)
    if _RANK_LINE.fullmatch(data.split(b"\n", 1)[0]):
        return TiktokenTokenizer(path, data)
    return SentencePieceTokenizer(path, data)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `texts`: all 256 bytes are in the alphabet, so nothing is unknown."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    # Through its JSON, like a loaded one: same code path, and `data` is exactly what save() writes.
    return HFTokenizer(None, hf.to_str(pretty=True).encode("utf-8"))


Tokenizer.train_bpe = staticmethod(train_bpe)  # existing callers use Tokenizer.train_bpe(...)


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """A model whose embedding is smaller than the tokenizer would index out of range."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}; "
            f"raise model.vocab_size to at least {tokenizer.vocab_size}"
        )
