"""`llama-jax average`: the mean of a run's checkpoints, streamed a parameter at a time, written as a parameters-only
checkpoint that init_from and convert read; bad input is one line, exit 2, nothing written."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import write_tiny_yaml

from llama_jax import cli
from llama_jax.checkpoint import specs
from llama_jax.checkpoint.durable import restore_params
from llama_jax.config import load_config
from llama_jax.interop import hf
from llama_jax.training.loop import train


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    """A tiny run with checkpoints at steps 2, 4, 6 and 8."""
    root = tmp_path_factory.mktemp("average")
    config_file = write_tiny_yaml(root, train={"steps": 8}, data={"sources": [str(corpus)]})
    train(load_config(str(config_file), [f"run.dir={root / 'run'}"]), print_fn=lambda _: None)
    return root / "run"


def params_of(step_dir: Path) -> dict:
    """The float32 parameters of a step directory, on one device, as numpy arrays."""
    model = specs.resolve(str(step_dir)).model
    return jax.tree.map(np.asarray, restore_params(step_dir, hf.single_device_target(model)))


def mean_of(run: Path, steps: list[int]) -> dict:
    """The reference: each checkpoint restored on its own, summed in float32 in step order, divided by the count."""
    trees = [params_of(run / "checkpoints" / str(step)) for step in steps]
    return jax.tree.map(
        lambda *leaves: np.sum(np.stack(leaves), axis=0, dtype=np.float32) / np.float32(len(leaves)), *trees
    )


def max_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("choice, steps", [(["--last", "3"], [4, 6, 8]), (["--steps", "2,6"], [2, 6])])
def test_the_average_is_the_mean_of_the_named_checkpoints(choice, steps, run, tmp_path, capsys):
    out = tmp_path / "averaged"
    assert cli.main(["average", str(run), *choice, "--out", str(out)]) == 0, capsys.readouterr().err
    averaged = params_of(out / "checkpoints" / "0")
    assert jax.tree.structure(averaged) == jax.tree.structure(params_of(run / "checkpoints" / "8"))
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(averaged))
    assert max_difference(averaged, mean_of(run, steps)) <= 1e-7
    assert max_difference(averaged, mean_of(run, [8])) > 1e-4  # a mean, not the newest checkpoint
    assert json.loads((out / "checkpoints" / "0" / "meta" / "metadata").read_text())["averaged_steps"] == steps
    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()


def test_the_average_over_a_mesh_is_the_same(run, tmp_path, capsys):
    """mesh.* keys shard the computation (here tensor x fsdp over the 8 simulated devices); the mean is the same."""
    out = tmp_path / "averaged"
    assert cli.main(["average", str(run), "--last", "2", "--out", str(out), "mesh.tensor=2"]) == 0
    assert max_difference(params_of(out / "checkpoints" / "0"), mean_of(run, [6, 8])) <= 1e-7


def test_an_averaged_checkpoint_starts_a_run_and_converts_to_hugging_face(run, tmp_path, capsys):
    averaged = tmp_path / "averaged"
    assert cli.main(["average", str(run), "--last", "2", "--out", str(averaged)]) == 0
    # checkpoint.init_from: a new run starts from the mean (one step at lr 1e-9 leaves it where it was).
    tuned = tmp_path / "tuned"
    assert (
        cli.main(
            [
                "train",
                str(run / "config.yaml"),
                f"run.dir={tuned}",
                f"checkpoint.init_from={averaged}",
                "train.steps=1",
                "train.lr=1e-9",
                "train.weight_decay=0",
            ]
        )
        == 0
    )
    assert f"initialised the params from {averaged}" in capsys.readouterr().out
    assert max_difference(params_of(tuned / "checkpoints" / "1"), params_of(averaged / "checkpoints" / "0")) <= 1e-7
    # convert to Hugging Face and back: the same parameters.
    assert cli.main(["convert", str(averaged), str(tmp_path / "hf")]) == 0
    assert cli.main(["convert", f"hf:{tmp_path / 'hf'}", str(tmp_path / "back")]) == 0
    assert (
        max_difference(params_of(tmp_path / "back" / "checkpoints" / "0"), params_of(averaged / "checkpoints" / "0"))
        == 0
    )


def with_meta(run: Path, copy: Path, step: int, change) -> Path:
    """A copy of the run whose checkpoint `step` says something else in its meta (`change` edits the dict)."""
    shutil.copytree(run, copy)
    metadata = copy / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(metadata.read_text())
    change(meta)
    metadata.write_text(json.dumps(meta))
    return copy


BAD = {
    "no-checkpoints": (
        lambda run, tmp: tmp / "empty_run",
        ["--last", "1"],
        "is a run directory without a finished checkpoint",
    ),
    "not-a-run": (lambda run, tmp: tmp, ["--last", "1"], "is not a run directory (no checkpoints/<step>/ in it)"),
    "missing-step": (lambda run, tmp: run, ["--steps", "4,5"], "--steps names step 5, and"),
    "too-many": (lambda run, tmp: run, ["--last", "5"], "--last 5, and"),
    "twice": (lambda run, tmp: run, ["--steps", "4,4"], "--steps names a step twice (4,4)"),
    "none": (lambda run, tmp: run, ["--last", "0"], "either --steps A,B,... or --last N with N >= 1"),
    "different-models": (
        lambda run, tmp: with_meta(run, tmp / "mixed", 8, lambda m: m["config"]["model"].update(ffn_dim=256)),
        ["--last", "2"],
        "checkpoints 6 and 8 of",
    ),
    "adapters": (
        lambda run, tmp: with_meta(run, tmp / "lora", 8, lambda m: m["config"].update(peft={"method": "lora"})),
        ["--last", "1"],
        "trains adapters (peft.method=lora)",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, run, tmp_path, capsys):
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty_run" / "config.yaml").write_text("seed: 0\n")
    make, choice, message = BAD[case]
    source = make(run, tmp_path)
    before = sorted(p for p in source.rglob("*"))
    out = tmp_path / "out"
    assert cli.main(["average", str(source), *choice, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llama-jax: error: average: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists() and sorted(p for p in source.rglob("*")) == before


def test_an_output_directory_that_holds_something_is_refused(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious\n")
    assert cli.main(["average", str(run), "--last", "1", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_the_documented_average_command(run, tmp_path, monkeypatch, capsys):
    """docs/configuration.md's `llama-jax average` as shown, on a copy of this module's run in its runs/wsd."""
    from test_readme import llama_jax_args, readme_commands

    monkeypatch.chdir(tmp_path)
    (command,) = readme_commands("llama-jax average")
    args = llama_jax_args(command)
    shutil.copytree(run, tmp_path / args[1])
    assert cli.main(args) == 0, capsys.readouterr().err
    out = tmp_path / args[args.index("--out") + 1]
    assert max_difference(params_of(out / "checkpoints" / "0"), mean_of(run, [4, 6, 8])) <= 1e-7
