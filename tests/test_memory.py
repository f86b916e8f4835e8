"""The per-device memory budget (run.device_memory_gb): the check before the first step, micro-batches
chosen to fit (train.microbatches=auto), and plan's verdict. Sizes come from XLA's memory analysis of
the compiled step, the same figure on CPU as on GPU."""

import dataclasses

import jax
import pytest
from conftest import tiny_config

from llama_jax.config import load_config
from llama_jax.distributed.sharding import make_mesh
from llama_jax.errors import ConfigError
from llama_jax.planning import plan, plan_report
from llama_jax.training.loop import train
from llama_jax.training.memory import check_fits, step_memory_bytes
from llama_jax.training.program import TrainProgram


def with_budget(config, microbatches, gib):
    return dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, microbatches=microbatches),
        run=dataclasses.replace(config.run, device_memory_gb=gib),
    )


@pytest.fixture(scope="module")
def needs():
    """GiB per device of the tiny step with 1, 2 and 4 micro-batches (8 rows on one device)."""
    config = tiny_config(train=dict(batch_size=8, seq_len=64), mesh=dict(fsdp=1))
    mesh = make_mesh(config, devices=jax.devices()[:1])
    return config, {
        n: step_memory_bytes(TrainProgram.build(with_budget(config, n, 0), mesh).compile_step()) / 2**30
        for n in (1, 2, 4)
    }


def test_auto_micro_batches_are_the_fewest_that_fit(needs):
    config, gib = needs
    assert gib[1] > gib[2] > gib[4]  # activations shrink with the micro-batch
    mesh = make_mesh(config, devices=jax.devices()[:1])
    for budget, expected in [(gib[1] * 1.01, 1), ((gib[1] + gib[2]) / 2, 2), ((gib[2] + gib[4]) / 2, 4)]:
        program = TrainProgram.build(with_budget(config, "auto", budget), mesh)
        assert program.config.train.microbatches == expected
    most = TrainProgram.build(with_budget(config, "auto", gib[4] / 10), mesh)  # none fits: the most, refused
    assert most.config.train.microbatches == 8
    with pytest.raises(ConfigError, match=r"the train step \(8 micro-batch\(es\), remat.policy=none\) needs .* over"):
        check_fits(most)


def test_a_step_over_the_budget_exits_before_writing_anything(needs, tmp_path, capsys):
    config, gib = needs
    over = dataclasses.replace(
        with_budget(config, 1, gib[1] / 2),
        run=dataclasses.replace(config.run, dir=str(tmp_path / "run"), device_memory_gb=gib[1] / 2),
        data=dataclasses.replace(config.data, cache_dir=str(tmp_path / "cache")),
    )
    with pytest.raises(
        ConfigError,
        match=r"the train step .* needs .* per device, over the budget of .* "
        r"\(run.device_memory_gb\); use train.microbatches=auto",
    ):
        train(over, devices=jax.devices()[:1])
    assert not (tmp_path / "run").exists()


def test_plan_says_whether_the_step_fits(needs):
    config, gib = needs
    mesh = make_mesh(config, devices=jax.devices()[:1])
    fits = plan.make_plan(with_budget(config, "auto", (gib[1] + gib[2]) / 2), mesh)
    assert fits.microbatches == 2 and fits.total_bytes <= fits.budget_bytes
    assert "fits the budget" in plan_report.format_plan(fits) and "2 micro-batches" in plan_report.format_plan(fits)
    assert "OVER the budget" in plan_report.format_plan(plan.make_plan(with_budget(config, 1, gib[1] / 2), mesh))


def test_microbatches_must_be_a_count_or_auto():
    assert load_config("tiny", ["train.microbatches=auto"]).train.microbatches == "auto"
    with pytest.raises(ConfigError, match="train.microbatches must be a positive count or auto"):
        load_config("tiny", ["train.microbatches=most"])
