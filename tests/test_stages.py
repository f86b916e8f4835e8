"""A staged run (train.stages, config/stages.py): a batch ramp, longer sequences and an annealing phase averaged at
the end, in one run that resumes anywhere; bad stage definitions are one line, exit 2, nothing written."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import COMPILE_FLAGS, subprocess_environment, write_tiny_yaml
from test_average import max_difference, mean_of, params_of

from llama_jax import cli
from llama_jax.checkpoint.durable import step_directories
from llama_jax.config import load_config
from llama_jax.config.stages import decay_saves, resolve, stage_at
from llama_jax.training.loop import train
from llama_jax.training.metrics import read_metrics

# Three stages over 12 steps: 4 x 32 tokens, then twice the batch (a ramp), then sequences twice as long; the decay
# phase is the last 4 steps (9-12), whose checkpoints (10, 12) are averaged into run.dir/averaged at the end. The
# third stage splits its sequences over 2 devices (mesh.sequence=2: context parallelism), a mesh of its own.
STAGED = [
    "train.steps=12",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.stages=[{start_step: 4, batch_size: 8}, {start_tokens: 1536, seq_len: 64, sequence: 2}]",
    "train.decay_steps=4",
    "checkpoint.every_steps=2",
    "checkpoint.keep=10",
    "checkpoint.average_decay=2",
]


def test_stages_resolve_from_steps_tokens_and_the_decay_phase():
    """start_tokens begins a stage at the step where the stages before it have trained that many tokens; a later
    stage keeps what it does not change; at_decay begins where the decay phase does; a stage that reads the same
    mix continues where the stages before it stopped (rows of its own length)."""
    config = load_config(
        "tiny",
        [
            "train.steps=100",
            "train.decay_steps=20",
            "train.stages=[{start_tokens: 81920, batch_tokens: 4096}, {start_step: 60, seq_len: 256}, "
            "{at_decay: true, sources: [a, b], weights: [1, 3]}]",
        ],
    )
    stages = resolve(config)
    # 16 x 128 = 2,048 tokens a step: 81,920 tokens after 40 steps.
    assert [(s.first_step, s.last_step) for s in stages] == [(0, 40), (40, 60), (60, 80), (80, 100)]
    assert [(s.config.train.batch_size, s.config.train.seq_len) for s in stages] == [
        (16, 128),
        (32, 128),
        (32, 256),
        (32, 256),
    ]
    assert stages[3].config.data.sources == ["a", "b"] and stages[3].config.data.weights == [1.0, 3.0]
    assert [s.first_row for s in stages[:3]] == [0, 40 * 16, -(-(40 * 16 * 129 + 20 * 32 * 129) // 257)]
    assert stages[3].first_row == 0  # another mix: its own stream from its beginning
    assert [stage_at(stages, step).index for step in (0, 1, 40, 41, 60, 61, 100)] == [0, 0, 0, 1, 1, 2, 3]
    assert stages[0].config is config  # the first stage is the run's own settings


BAD_STAGES = [
    (["train.stages=[{start_step: 0, batch_size: 8}]"], "train.stages[0] begins at step 0, not after the first stage"),
    (
        ["train.stages=[{start_step: 90}, {start_step: 50}]"],
        "train.stages[1] begins at step 50, not after train.stages[0]",
    ),
    (["train.stages=[{seq_len: 64}]"], "train.stages[0] must say where it begins with one of start_step"),
    (
        ["train.stages=[{start_step: 10, seq_len: 4096}]"],
        "train.stages[0] (stage 2/2, from step 10): train.seq_len (4096) exceeds model.max_seq_len (1024)",
    ),
    (["train.stages=[{start_step: 10, weights: [1, 2]}]"], "train.stages[0].weights has 2 value(s) for its 1 source"),
    (["train.stages=[{start_step: 10, batch_tokens: 100}]"], "is not a multiple of its sequence length (128)"),
    (["train.stages=[{start_step: 10, bogus: 1}]"], "'train.stages[0]' has no field 'bogus'"),
    (["train.stages=[{at_decay: true}]"], "begins at the decay phase (at_decay), and the run has none"),
    (["checkpoint.average_decay=1", "train.decay_steps=20"], "averages one checkpoint, which is that checkpoint"),
    (["checkpoint.average_decay=-1"], "checkpoint.average_decay must be >= 0 (0: none), got -1"),
    (
        ["checkpoint.average_decay=5", "train.decay_steps=4"],
        "checkpoints of a decay phase of 4 step(s): average at most 4",
    ),
    (["checkpoint.average_decay=2"], "and the run has no decay phase"),
]


@pytest.mark.parametrize("overrides, message", BAD_STAGES, ids=[m[:40] for _, m in BAD_STAGES])
def test_a_bad_stage_definition_is_one_line_exit_2_and_nothing_written(overrides, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", "tiny", f"run.dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> Path:
    """The staged run, uninterrupted, on 2 devices."""
    root = tmp_path_factory.mktemp("stages")
    config_file = write_tiny_yaml(root, data={"sources": [str(corpus)]})
    config = load_config(str(config_file), [*STAGED, f"run.dir={root / 'run'}"])
    train(config, print_fn=lambda _: None, devices=jax.devices()[:2])
    return root / "run"


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss, as the metrics log has it."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_a_staged_run_logs_each_stage_and_averages_its_decay_phase(straight):
    records = read_metrics(straight / "metrics.jsonl")
    changes = [(r["step"], r["stage"], r["stage_batch_size"], r["stage_seq_len"]) for r in records if "stage" in r]
    assert changes == [(4, 2, 8, 32), (8, 3, 8, 64)]  # 4 x 4 x 32 + 4 x 8 x 32 = 1,536 tokens by step 8
    assert sorted(losses(straight)) == list(range(1, 13))
    assert decay_saves(load_config(str(straight / "config.yaml"))) == [10, 12]
    averaged = straight / "averaged" / "checkpoints" / "0"
    assert json.loads((averaged / "meta" / "metadata").read_text())["averaged_steps"] == [10, 12]
    assert max_difference(params_of(averaged), mean_of(straight, [10, 12])) <= 1e-7


def test_a_staged_run_resumed_inside_its_second_stage_on_the_same_devices_has_the_same_losses(straight, tmp_path):
    """As if killed at step 7 (inside stage 2, after its save at 6): resumed on the same 2 devices, the losses of
    steps 7-12 are the straight run's exactly, and so is the average."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / "averaged")
    for step in (8, 10, 12):
        shutil.rmtree(run_dir / "checkpoints" / str(step))
    config = load_config(str(run_dir / "config.yaml"), [f"run.dir={run_dir}"])
    before, messages = len(read_metrics(run_dir / "metrics.jsonl")), []
    train(config, print_fn=messages.append, devices=jax.devices()[:2])
    assert any("resumed from" in m and m.endswith("/6") for m in messages), messages
    assert not any("data settings or sources changed" in m for m in messages), messages
    assert "continuing in stage 2/3 at step 7" in messages
    resumed = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[before:] if "loss" in r}
    assert resumed == {s: loss for s, loss in losses(straight).items() if s >= 7}
    averaged = params_of(run_dir / "averaged" / "checkpoints" / "0")
    assert max_difference(averaged, params_of(straight / "averaged" / "checkpoints" / "0")) == 0


@pytest.mark.slow
def test_a_staged_run_killed_inside_its_second_stage_resumes_on_another_data_parallel_size(straight, tmp_path, corpus):
    """The staged run as its own process on 2 devices, SIGKILLed once it has logged step 7 (stage 2: steps 5-8),
    then resumed on 4 (another data-parallel size): the losses from there on are the straight run's within 1e-5,
    the average is the mean of its checkpoints."""
    run_dir, config_file = tmp_path / "run", write_tiny_yaml(tmp_path, data={"sources": [str(corpus)]})
    env = subprocess_environment() | {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {COMPILE_FLAGS}"}
    slow = ["inject.process=0", "inject.step_delay_s=0.3"]  # time to see step 7 before the run ends
    command = [sys.executable, "-m", "llama_jax", "train", str(config_file), *STAGED, f"run.dir={run_dir}", *slow]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or max(losses(run_dir), default=0) < 7:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    killed_at = max(losses(run_dir))
    saved = max(step_directories(run_dir / "checkpoints"))
    assert 5 <= killed_at <= 8 and saved in (6, 8), (killed_at, saved)  # inside stage 2
    before, messages = len(read_metrics(run_dir / "metrics.jsonl")), []
    train(
        load_config(str(config_file), [*STAGED, f"run.dir={run_dir}"]),
        print_fn=messages.append,
        devices=jax.devices()[:4],
    )
    assert any("resumed from" in m and m.endswith(f"/{saved}") for m in messages), messages
    resumed = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")[before:] if "loss" in r}
    steps = range(saved + 1, 13)
    assert sorted(resumed) == list(steps)
    expected = losses(straight)
    np.testing.assert_allclose([resumed[s] for s in steps], [expected[s] for s in steps], rtol=1e-5, atol=0)
    averaged = params_of(run_dir / "averaged" / "checkpoints" / "0")
    assert max_difference(averaged, mean_of(run_dir, [10, 12])) <= 1e-7


def test_a_stage_stream_begins_at_its_first_row(tmp_path, corpus):
    """A later stage's batches are its mix's rows from first_row on: batch 0 of a stream begun at row 2 x B is
    batch 2 of the stream from the beginning."""
    from llama_jax.data.streams import open_data

    config = load_config(
        "tiny",
        [f"data.sources=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", "train.batch_size=4", "train.seq_len=32"],
    )
    whole, later = open_data(config, lambda _: None), open_data(config, lambda _: None, first_row=8)
    for key, value in later.train.batch(0).items():
        np.testing.assert_array_equal(value, whole.train.batch(2)[key])
    assert later.fingerprint != whole.fingerprint


def test_the_averaged_checkpoints_are_kept_and_a_stage_past_the_end_is_not_trained(tmp_path, corpus, capsys):
    """checkpoint.average_decay's checkpoints are saved and kept whatever every_steps and keep say (keep=1 keeps only
    the newest of the others); a stage that begins after a shortened run's end is named and not trained."""
    run_dir = tmp_path / "run"
    config_file = write_tiny_yaml(tmp_path, data={"sources": [str(corpus)]})
    overrides = [
        f"run.dir={run_dir}",
        "train.steps=6",
        "train.decay_steps=4",
        "checkpoint.average_decay=2",
        "checkpoint.every_steps=1",
        "checkpoint.keep=1",
        "train.stages=[{start_step: 100, batch_size: 8}]",
    ]
    assert cli.main(["train", str(config_file), *overrides]) == 0
    out = capsys.readouterr().out
    assert "note: train.stages [0] begin after this run's 6 steps" in out, out
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6]
    assert "averaged 2 checkpoint(s)" in out and (run_dir / "averaged" / "checkpoints" / "0").is_dir()
    assert not any("stage" in r for r in read_metrics(run_dir / "metrics.jsonl"))
    # Stopped after its last save but before its average was written: the same command writes it.
    shutil.rmtree(run_dir / "averaged")
    assert cli.main(["train", str(config_file), *overrides]) == 0
    assert "already trained to step 6" in capsys.readouterr().out
    assert json.loads((run_dir / "averaged" / "checkpoints" / "0" / "meta" / "metadata").read_text())[
        "averaged_steps"
    ] == [4, 6]


def test_a_planned_decay_checkpoint_held_back_by_a_bad_step_is_named_and_the_others_averaged(tmp_path, corpus, capsys):
    """A NaN batch at step 5 (inject.nan_steps counts batches from 0), a planned decay-phase save: the guard holds
    that save for the next good step (6, also planned), so the phase has checkpoints 4 and 6 of the planned 4, 5, 6.
    The run says so and averages those two."""
    run_dir = tmp_path / "run"
    config_file = write_tiny_yaml(tmp_path, data={"sources": [str(corpus)]})
    overrides = ["train.steps=6", "train.decay_steps=4", "checkpoint.average_decay=3", "inject.nan_steps=[4]"]
    assert cli.main(["train", str(config_file), f"run.dir={run_dir}", *overrides]) == 0
    out = capsys.readouterr().out
    assert "warning: checkpoint.average_decay planned steps [4, 5, 6]; the decay phase's checkpoints are [4, 6]" in out
    averaged = run_dir / "averaged" / "checkpoints" / "0"
    assert json.loads((averaged / "meta" / "metadata").read_text())["averaged_steps"] == [4, 6]
    assert max_difference(params_of(averaged), mean_of(run_dir, [4, 6])) <= 1e-7


def test_a_stage_whose_sources_have_another_tokenizer_is_one_line_exit_2_and_nothing_written(tmp_path, corpus, capsys):
    """Each raw source trains its own tokenizer (data.tokenizer=bpe): a later stage on other text would feed the
    model other token ids. Refused before anything is written."""
    other = tmp_path / "other"
    other.mkdir()
    rng = np.random.default_rng(1)
    words = ["zebra", "quartz", "vexing", "jumpy", "fjord", "waltz", "nymph", "glyph", "crwth", "sphinx"]
    for i in range(40):
        (other / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 200)))
    run_dir = tmp_path / "run"
    config_file = write_tiny_yaml(tmp_path, data={"sources": [str(corpus)]})
    stages = f"train.stages=[{{start_step: 2, sources: [{other}]}}]"
    assert cli.main(["train", str(config_file), f"run.dir={run_dir}", "train.steps=4", stages]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "stage 2/2" in err and "was prepared with another tokenizer than the first stage's" in err, err
    assert not run_dir.exists()


def test_the_recipe_guide_trains_its_stages_and_averages(tmp_path, monkeypatch, capsys):
    """docs/recipe.md's three-stage tiny run, as shown: every stage begins where the guide says, and the decay
    phase's three checkpoints are averaged into run.dir/averaged."""
    from test_readme import llama_jax_args, readme_commands

    (command,) = [c for c in readme_commands("llama-jax train") if "train.stages=" in c]
    monkeypatch.chdir(tmp_path)
    # Not the point here: the sample, a long evaluation, the model's width (the stages are the guide's).
    quick = [f"data.cache_dir={tmp_path / 'cache'}", "train.sample_tokens=0", "train.eval_batches=1"]
    quick += ["model.d_model=64", "model.ffn_dim=192", "model.vocab_size=512"]
    assert cli.main([*llama_jax_args(command), *quick]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "staged"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["stage"]) for r in records if "stage" in r] == [(8, 2), (14, 3)]
    assert "stage 2/3: steps 9-14, batch 32 x 128 (4,096 tokens)" in out
    averaged = run_dir / "averaged" / "checkpoints" / "0"
    assert json.loads((averaged / "meta" / "metadata").read_text())["averaged_steps"] == [20, 22, 24]
    assert "averaged 3 checkpoint(s) of runs/staged (steps 20, 22, 24) -> runs/staged/averaged/" in out


def test_microbatches_auto_tries_the_next_count_when_a_compile_fails(monkeypatch):
    """XLA:GPU rejects some micro-batch counts of some layouts (an internal error in its HLO verifier): the search
    of train.microbatches=auto moves on to the next count instead of failing the run."""
    from conftest import tiny_config

    from llama_jax.distributed import sharding
    from llama_jax.training import memory
    from llama_jax.training.program import TrainProgram

    real = memory.memory_bytes

    def rejects_one(program):
        if program.config.train.microbatches == 1:
            raise jax.errors.JaxRuntimeError("INTERNAL: during context [hlo verifier]: (as XLA:GPU's)")
        return real(program)

    monkeypatch.setattr(memory, "memory_bytes", rejects_one)  # what the search asks of each count
    config = tiny_config(train=dict(microbatches="auto", batch_size=4))
    program = TrainProgram.build(config, sharding.make_mesh(config, devices=jax.devices()[:1]))
    assert program.config.train.microbatches == 2
