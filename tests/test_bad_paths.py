"""Every command's path arguments, each missing, empty, of the wrong kind or chmod 000: one line on stderr that
starts like every error of the CLI, exit 2, and nothing written (no output made, the inputs as they were). In
process (cli.main): every case stops before anything compiles or tokenizes, so the sweep takes seconds."""

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llama_jax import cli
from llama_jax.data.tokenizer import train_bpe

GOLDEN = Path(__file__).resolve().parent / "golden" / "hf" / "gqa_llama3_untied"

# Each path argument: what the command does there (reads a "dir" or a "file", or writes an "out-dir" or an
# "out-file"), the name the bad path gets (a file's suffix is the one the argument wants, so that an empty file is
# refused for being empty, not for its suffix), and the command line, PATH standing for it. The other arguments are
# valid: MODEL is a Hugging Face model with its tokenizer, TEXT a text file, OUT a new directory.
PATH_ARGUMENTS = {
    "convert SOURCE": ("dir", "run", ["convert", "PATH", "OUT"]),
    "convert OUT": ("out-dir", "converted", ["convert", "hf:MODEL", "PATH"]),
    "average RUN_DIR": ("dir", "run", ["average", "PATH", "--last", "1", "--out", "OUT"]),
    "average --out": ("out-dir", "averaged", ["average", "MODEL", "--last", "1", "--out", "PATH"]),
    "eval MODEL": ("dir", "run", ["eval", "PATH", "TEXT"]),
    "eval DATA": ("dir", "data", ["eval", "hf:MODEL", "PATH"]),
    "generate MODEL": ("dir", "run", ["generate", "PATH", "--prompt", "To be"]),
    "generate ADAPTER@MODEL": ("dir", "adapter", ["generate", "PATH@hf:MODEL", "--prompt", "To be"]),
    "convert ADAPTER@MODEL": ("dir", "adapter", ["convert", "PATH@hf:MODEL", "OUT", "--merge"]),
    "generate --tokenizer": (
        "file",
        "tokenizer.json",
        ["generate", "hf:MODEL", "--prompt", "To be", "--tokenizer", "PATH"],
    ),
    "goodput --from": ("dir", "run", ["goodput", "--gpus", "8", "--from", "PATH"]),
    "report RUN_DIR": ("dir", "run", ["report", "PATH"]),
    "profile RUN_DIR": ("dir", "run", ["profile", "PATH"]),
    "doctor CONFIG": ("file", "config.yaml", ["doctor", "PATH"]),
    "prepare INPUT": ("file", "notes.txt", ["prepare", "PATH", "--out", "OUT", "--train-tokenizer", "300"]),
    "prepare --tokenizer": ("file", "tokenizer.json", ["prepare", "TEXT", "--out", "OUT", "--tokenizer", "PATH"]),
    "prepare --out": ("out-dir", "store", ["prepare", "TEXT", "--out", "PATH", "--train-tokenizer", "300"]),
    "tune --out": ("out-file", "tune.yaml", ["tune", "--out", "PATH", "--dry-run"]),
}
# A path that is read must exist, hold something, be of its kind and be readable. One that is written may be new or
# empty (the command makes or fills it), so there only the other kind in its place, or chmod 000, is bad.
READ_CASES = ("missing", "empty", "wrong-kind", "chmod-000")
WRITE_CASES = ("wrong-kind", "chmod-000")
CASES = [
    (argument, case)
    for argument, (does, _, _) in PATH_ARGUMENTS.items()
    for case in (WRITE_CASES if does.startswith("out-") else READ_CASES)
]


@functools.cache
def chmod_stops_reads() -> bool:
    """Whether a file with mode 000 refuses this process (not for root, whose CAP_DAC_OVERRIDE reads anything)."""
    with tempfile.TemporaryDirectory() as directory:
        probe = Path(directory) / "probe"
        probe.write_text("x")
        probe.chmod(0)
        try:
            probe.read_text()
            return False
        except PermissionError:
            return True
        finally:
            probe.chmod(0o600)


def make_bad(path: Path, case: str, does: str) -> None:
    """Put the `case` of bad path at `path` for an argument that `does` what PATH_ARGUMENTS says."""
    wants_dir = does in ("dir", "out-dir")
    if case == "missing":
        return
    if case == "empty":
        path.mkdir() if wants_dir else path.write_text("")
    elif case == "wrong-kind":
        if wants_dir:
            path.write_text("not a directory\n")
        else:
            path.mkdir()
            (path / "notes.bin").write_text("not the file wanted\n")
    elif wants_dir:  # chmod-000: a directory with something in it (an output directory: empty, as a new one may be)
        path.mkdir()
        if does == "dir":
            (path / "notes.txt").write_text("to be or not to be\n")
    else:
        path.write_text("seed: 1\n")


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The golden Hugging Face model with a byte-level BPE beside it: a valid MODEL for the other arguments."""
    directory = tmp_path_factory.mktemp("model") / "model"
    shutil.copytree(GOLDEN, directory)
    train_bpe(["to be or not to be, that is the question"] * 20, 300).save(directory)
    return directory


@pytest.mark.parametrize("argument, case", CASES, ids=[f"{a.replace(' ', '_')}-{c}" for a, c in CASES])
def test_a_bad_path_is_one_line_exit_2_and_nothing_written(argument, case, model, tmp_path, monkeypatch, capsys):
    does, name, command = PATH_ARGUMENTS[argument]
    if case == "chmod-000" and not chmod_stops_reads():
        pytest.skip("running as root: chmod 000 stops neither its reads nor its writes")
    monkeypatch.chdir(tmp_path)  # a relative output would land here, and be seen
    (tmp_path / "text.txt").write_text("to be or not to be, that is the question\n" * 50)
    bad = tmp_path / name
    make_bad(bad, case, does)
    before, model_before = snapshot(tmp_path), snapshot(model)
    values = {"PATH": bad, "MODEL": model, "TEXT": tmp_path / "text.txt", "OUT": tmp_path / "out"}
    if case == "chmod-000":
        bad.chmod(0)
    try:
        status = cli.main(
            [
                str(values.get(part, part)).replace("hf:MODEL", f"hf:{model}").replace("PATH@", f"{bad}@")
                for part in command
            ]
        )
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    finally:
        if os.path.lexists(bad):
            bad.chmod(0o700 if bad.is_dir() else 0o600)

    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("llama-jax: error: ") and err.count("\n") == 1, err
    assert name in err, err  # names the path
    assert snapshot(tmp_path) == before and snapshot(model) == model_before


def test_convert_of_a_run_without_a_checkpoint_yet_says_so(tmp_path, capsys):
    """A run that has not saved yet (its config and metrics written, checkpoints/ empty): one line that says what it
    lacks, exit 2, OUT not made."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text("")
    assert cli.main(["convert", str(run), str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"llama-jax: error: {run} is a run directory without a finished checkpoint yet (none in {run / 'checkpoints'})"
    )
    assert not (tmp_path / "out").exists()
