"""The learning rate schedule: warmup given in steps or as a fraction of the run, cosine or warmup-stable-decay, the
linear decay (annealing) phase, and the refusals of schedules that do not fit in the run."""

import pytest

from llama_jax import cli
from llama_jax.config import load_config
from llama_jax.errors import ConfigError
from llama_jax.training.optimizer import learning_rate


def schedule_of(*overrides: str):
    return learning_rate(load_config("tiny", list(overrides)).train)


def test_a_warmup_fraction_resolves_to_whole_steps_of_the_run():
    assert load_config("tiny").train.resolved_warmup_steps == 40  # the preset's 0.134 of 300 steps
    assert load_config("tiny", ["train.steps=10"]).train.resolved_warmup_steps == 1
    assert load_config("tiny", ["train.warmup_fraction=0.99", "train.steps=10"]).train.resolved_warmup_steps == 9
    assert load_config("tiny", ["train.warmup_steps=7"]).train.resolved_warmup_steps == 7  # explicit steps win
    assert load_config("llama3_405b").train.resolved_warmup_steps == 8000  # Llama 3 405B's, at the preset's length
    assert load_config("llama3_8b").train.resolved_warmup_steps == 192  # 1%
    decay = load_config("tiny", ["train.schedule=wsd", "train.decay_fraction=0.2"]).train
    assert (decay.resolved_decay_steps, load_config("tiny", ["train.decay_steps=30"]).train.resolved_decay_steps) == (
        60,
        30,
    )


def test_wsd_warms_up_holds_then_decays_linearly_to_exactly_the_final_lr():
    lr = 1e-3
    schedule = schedule_of(
        "train.schedule=wsd",
        "train.steps=100",
        f"train.lr={lr}",
        "train.warmup_steps=10",
        "train.decay_steps=20",
        "train.min_lr_ratio=0",
    )
    assert float(schedule(0)) == pytest.approx(lr / 11, rel=1e-6)  # the first step already learns
    assert float(schedule(5)) == pytest.approx(lr / 11 + (lr - lr / 11) * 5 / 10, rel=1e-6)
    for step in (10, 50, 80):  # the stable plateau, up to the decay phase's first step
        assert float(schedule(step)) == pytest.approx(lr, rel=1e-6)
    assert float(schedule(90)) == pytest.approx(lr / 2, rel=1e-6)  # halfway down the decay
    assert float(schedule(99)) == pytest.approx(lr / 20, rel=1e-6)
    assert float(schedule(100)) == 0.0  # exactly the final lr at step train.steps


def test_wsd_decays_to_a_floor_given_as_a_ratio_of_the_peak():
    schedule = schedule_of(
        "train.schedule=wsd",
        "train.steps=50",
        "train.lr=2e-3",
        "train.warmup_steps=0",
        "train.decay_fraction=0.5",
        "train.min_lr_ratio=0.25",
    )
    assert float(schedule(0)) == pytest.approx(2e-3, rel=1e-6)  # no warmup: the peak from the first step
    assert float(schedule(25)) == pytest.approx(2e-3, rel=1e-6)
    assert float(schedule(50)) == pytest.approx(5e-4, rel=1e-7)


def test_a_decay_phase_after_cosine_starts_where_cosine_is_and_ends_at_the_floor():
    plain = schedule_of("train.steps=100", "train.lr=1e-3", "train.warmup_steps=10", "train.min_lr_ratio=0.1")
    annealed = schedule_of(
        "train.steps=100", "train.lr=1e-3", "train.warmup_steps=10", "train.min_lr_ratio=0.1", "train.decay_steps=10"
    )
    for step in (0, 5, 10, 50, 90):  # the same cosine up to the decay phase
        assert float(annealed(step)) == pytest.approx(float(plain(step)), rel=1e-6)
    assert float(annealed(95)) == pytest.approx((float(plain(90)) + 1e-4) / 2, rel=1e-5)  # linear, not cosine
    assert float(annealed(100)) == pytest.approx(1e-4, rel=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.steps=10", "train.warmup_steps=10"], "train.warmup_steps (10) is not below train.steps (10)"),
        (["train.schedule=wsd"], "train.schedule=wsd holds train.lr until a decay phase, and it has none"),
        (["train.schedule=linear"], "train.schedule must be one of cosine, wsd, got 'linear'"),
        (
            ["train.steps=100", "train.warmup_steps=30", "train.decay_steps=80"],
            "warmup (30 steps, train.warmup_steps) and decay (80 steps, train.decay_steps) add up to more than "
            "train.steps (100)",
        ),
        (
            ["train.steps=100", "train.warmup_fraction=0.5", "train.decay_fraction=0.6"],
            "warmup (50 steps, train.warmup_fraction=0.5) and decay (60 steps, train.decay_fraction=0.6)",
        ),
        (["train.decay_steps=-2"], "train.decay_steps must be >= 0 or -1 (-1: train.decay_fraction of train.steps)"),
        (["train.warmup_fraction=1"], "train.warmup_fraction must be in [0, 1), got 1.0"),
        (["train.decay_fraction=-0.1"], "train.decay_fraction must be in [0, 1], got -0.1"),
    ],
)
def test_a_schedule_that_does_not_fit_is_refused_in_one_line_with_exit_2(overrides, message, tmp_path, capsys):
    with pytest.raises(ConfigError) as refused:
        load_config("tiny", overrides)
    assert message in str(refused.value)
    run_dir = tmp_path / "run"
    assert cli.main(["train", "tiny", *overrides, f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llama-jax: error: ") and len(err.splitlines()) == 1 and message in err
    assert not run_dir.exists()


@pytest.mark.parametrize("preset", ["tiny", "bench", "llama3_8b", "llama3_405b"])
def test_a_quick_run_of_any_preset_loads(preset):
    """Shortening train.steps shortens the presets' warmup: a 10-step run is no longer refused."""
    t = load_config(preset, ["train.steps=10"]).train
    assert t.resolved_warmup_steps < 10


def test_a_quick_tiny_run_trains_through_the_cli(tmp_path, corpus, capsys):
    """`llama-jax train tiny train.steps=10` runs (a smaller model and batch here, for the test's time)."""
    run_dir = tmp_path / "run"
    status = cli.main(
        [
            "train",
            "tiny",
            "train.steps=10",
            "train.batch_size=8",
            "train.seq_len=32",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.sample_tokens=0",
            "model.vocab_size=320",
            "model.d_model=64",
            "model.ffn_dim=128",
            "run.tensorboard=false",
            f"data.sources=[{corpus}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"run.dir={run_dir}",
        ]
    )
    assert status == 0, capsys.readouterr().err
    assert (run_dir / "checkpoints" / "10").is_dir()
