"""Pipeline parallelism (pipeline.py): stages over micro-batches train to one device's numbers in every
composition, checkpoints move between pipeline layouts, `plan` reports the bubble, bad layouts are refused."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from conftest import TINY_MODEL, tiny_config
from test_fault import config_for
from test_fault import losses as logged_losses
from test_fault import train_quietly
from test_sharding import losses

from llama_jax import cli
from llama_jax import config as config_lib
from llama_jax.distributed import sharding
from llama_jax.model import pipeline
from llama_jax.training.plan import make_plan

# Four layers: four stages of one, or two stages of two (or of one, twice, with repeats).
MODEL = dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=2, n_layers=4)
MICROBATCHES = 4  # of the tiny batch of 8 rows


@pytest.fixture(scope="module")
def one_device():
    """The same 5 steps on one device, accumulating the gradient over the same micro-batches."""
    cfg = tiny_config(model=dataclasses.asdict(MODEL), train=dict(lr=1e-2, microbatches=MICROBATCHES))
    return losses(cfg, jax.devices()[:1])


@pytest.mark.parametrize("mesh, remat", [
    (dict(pipeline=4, fsdp=2), {}),
    (dict(pipeline=2, tensor=2, fsdp=2, sequence_parallel=True, pipeline_microbatches=2), {}),  # 2 passes
    (dict(pipeline=2, fsdp=2, sequence=2), {}),
    (dict(pipeline=2, pipeline_repeats=2, fsdp=2), dict(policy="full")),
], ids=["pipeline4xfsdp2", "pipeline2xtensor2-sp-two-passes", "pipeline2xfsdp2xsequence2", "pipeline2-repeats2-remat-full"])
def test_pipelined_losses_match_one_device(mesh, remat, one_device):
    """First 5 losses (fp32, packed documents) within 1e-5 relative of one device."""
    cfg = tiny_config(model=dataclasses.asdict(MODEL), train=dict(lr=1e-2, microbatches=MICROBATCHES),
                      mesh=mesh, remat=remat)
    devices = int(np.prod([v for k, v in mesh.items() if k in ("pipeline", "fsdp", "tensor", "sequence")]))
    np.testing.assert_allclose(losses(cfg, jax.devices()[:devices]), one_device, rtol=1e-5)


def test_storage_order_gives_each_stage_its_groups_and_inverts():
    layers = {"layers": np.arange(8)}  # 8 layers, 2 stages x 2 repeats: groups of 2
    stored = pipeline.to_storage_order(layers, stages=2, repeats=2)["layers"]
    # stage 0 holds groups 0 and 2 (layers 0-1, 4-5), stage 1 groups 1 and 3
    assert stored.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert pipeline.to_natural_order({"layers": stored}, 2, 2)["layers"].tolist() == list(range(8))
    assert pipeline.to_storage_order(layers, 4, 1)["layers"].tolist() == list(range(8))  # no repeats: natural


@pytest.fixture(scope="module")
def saved_on_pipeline2x2(tmp_path_factory, corpus):
    """(losses of a straight 8-step run on one device, config of a 4-step run on pipeline=2 with repeats=2
    whose checkpoints hold the layers in its storage order), at a constant learning rate."""
    root = tmp_path_factory.mktemp("pipelined")
    common = dict(model=dataclasses.asdict(MODEL), train=dict(steps=8, min_lr_ratio=1.0, microbatches=MICROBATCHES))
    straight = config_for(root / "straight", corpus, **common, mesh=dict(fsdp=1))
    train_quietly(straight, devices=jax.devices()[:1])
    half = config_for(root / "half", corpus, **{**common, "train": {**common["train"], "steps": 4}},
                      mesh=dict(pipeline=2, pipeline_repeats=2, fsdp=2))
    train_quietly(half, devices=jax.devices()[:4])
    return logged_losses(straight.run.dir), half


@pytest.mark.parametrize("mesh", [dict(pipeline=1, fsdp=1), dict(pipeline=4, pipeline_repeats=1, fsdp=2)],
                         ids=["to-one-device", "to-pipeline4"])
def test_a_pipelined_checkpoint_resumes_on_another_layout_with_the_same_losses(mesh, tmp_path, saved_on_pipeline2x2):
    expected, half = saved_on_pipeline2x2
    for step in (1, 2, 3, 4):  # the pipelined run itself follows one device
        np.testing.assert_allclose(logged_losses(half.run.dir)[step], expected[step], rtol=1e-5)
    run_dir = tmp_path / "run"
    shutil.copytree(half.run.dir, run_dir)
    moved = dataclasses.replace(half, run=dataclasses.replace(half.run, dir=str(run_dir)),
                                train=dataclasses.replace(half.train, steps=8),
                                mesh=dataclasses.replace(half.mesh, **mesh))
    messages = []
    devices = mesh["pipeline"] * mesh["fsdp"]
    train_quietly(moved, devices=jax.devices()[:devices], messages=messages)
    assert f"resumed from {run_dir / 'checkpoints' / '4'}" in messages
    got = logged_losses(run_dir)
    np.testing.assert_allclose([got[s] for s in (5, 6, 7, 8)], [expected[s] for s in (5, 6, 7, 8)], rtol=1e-5)


@pytest.mark.parametrize("stages, microbatches, repeats, per_pass", [(2, 2, 1, 2), (2, 4, 2, 2), (4, 8, 1, 8)])
def test_plan_reports_the_bubble_of_the_schedule_and_of_the_compiled_loop(stages, microbatches, repeats, per_pass,
                                                                         capsys):
    """per_pass < microbatches: passes through the pipeline, the gradient accumulated over them."""
    overrides = ["model.n_layers=4", f"mesh.pipeline={stages}", f"mesh.pipeline_repeats={repeats}", "mesh.fsdp=1",
                 f"train.microbatches={microbatches}", "train.batch_size=16", f"mesh.pipeline_microbatches={per_pass}"]
    if repeats == 1 and stages == 2:  # bf16, as on GPUs (XLA:CPU once aborted compiling its sums over the stages)
        overrides.append("model.compute_dtype=bfloat16")
    devices = jax.devices()[:stages]
    if stages == 4:  # the command, as users run it (on all 8 devices: fsdp fills the rest)
        assert cli.main(["plan", "tiny", *overrides[:3], "mesh.fsdp=2", *overrides[4:], "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
    else:
        cfg = config_lib.load_config("tiny", overrides)
        plan = dataclasses.asdict(make_plan(cfg, sharding.make_mesh(cfg, devices=devices)))
    formula = (stages - 1) / (per_pass * repeats + stages - 1)
    assert plan["mesh"]["pipeline"] == stages and plan["bubble"] == pytest.approx(formula)
    assert plan["pipeline_iterations"] == per_pass * repeats + stages - 1  # as compiled, read from the HLO
    assert plan["compiled_bubble"] == pytest.approx(formula)
    assert plan["collective_bytes"]["collective-permute"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["mesh.pipeline=4", "mesh.fsdp=2", "train.microbatches=4", "train.batch_size=8"],
     "model.n_layers (2) must be divisible by mesh.pipeline × mesh.pipeline_repeats (4 × 1)"),
    (["model.n_layers=4", "mesh.pipeline=2", "mesh.pipeline_repeats=4", "mesh.fsdp=4", "train.microbatches=2"],
     "model.n_layers (4) must be divisible by mesh.pipeline × mesh.pipeline_repeats (2 × 4)"),
    (["model.n_layers=4", "mesh.pipeline=4", "mesh.fsdp=2", "train.microbatches=2", "train.batch_size=8"],
     "mesh.pipeline=4 needs train.microbatches to be a multiple of 4"),
    (["model.n_layers=4", "mesh.pipeline=2", "mesh.fsdp=4", "train.microbatches=2", "mesh.pipeline_microbatches=4"],
     "train.microbatches (2) must be a multiple of mesh.pipeline_microbatches (4)"),
    (["mesh.pipeline=0"], "mesh.pipeline and mesh.pipeline_repeats must be positive"),
])
def test_bad_pipeline_layouts_exit_2_with_one_line(overrides, message, capsys):
    assert cli.main(["plan", "tiny", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_the_readme_405b_layout_passes_the_mesh_checks():
    """The README's dry run on 2,016 nodes of 8 GPUs: its mesh and batch arithmetic, checked without devices."""
    from test_readme import readme_commands

    (command,) = [c for c in readme_commands("launch/slurm.sbatch") if "llama3_405b" in c]
    words = command.split()
    overrides = [w for w in words if "=" in w and not w.startswith("run.dir")]
    cfg = config_lib.load_config("llama3_405b", overrides)
    devices = 8 * int(words[words.index("--nodes") + 1])
    sizes = sharding.mesh_shape(cfg.mesh, devices)
    sharding.check_divisibility(cfg, sizes)  # raises ConfigError, one line, if anything does not divide
    assert sizes == {"pipeline": 14, "data": 1, "fsdp": 144, "sequence": 1, "tensor": 8}
    assert pipeline.bubble_fraction(14, cfg.train.microbatches, cfg.mesh.pipeline_repeats) == pytest.approx(13 / 55)

