"""Pipeline parallelism (pipeline.py, stack/gpipe.py, stack/one_f_one_b.py, stages.py): stages over micro-batches
train to one device's numbers in every composition and under both schedules, even and uneven; the 1F1B tables keep
their hand-offs; checkpoints move between pipeline layouts and schedules; `plan` reports the bubble and the stages;
bad layouts are refused."""

import dataclasses
import json
import shlex
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL, tiny_config
from test_fault import config_for, train_quietly
from test_fault import losses as logged_losses
from test_sharding import losses

from llama_jax import cli
from llama_jax import config as config_lib
from llama_jax.distributed import sharding
from llama_jax.model import pipeline
from llama_jax.model import residuals as residuals_lib
from llama_jax.model.stack import one_f_one_b_schedule
from llama_jax.model.stages import LayerOrder, relayout, to_natural_order, to_storage_order
from llama_jax.planning.plan import make_plan

# Four layers: four stages of one, or two stages of two (or of one, twice, with repeats).
MODEL = dataclasses.replace(TINY_MODEL, n_heads=8, n_kv_heads=2, n_layers=4)
MICROBATCHES = 4  # of the tiny batch of 8 rows


@pytest.fixture(scope="module")
def one_device():
    """The same 5 steps on one device, accumulating the gradient over the same micro-batches."""
    cfg = tiny_config(model=dataclasses.asdict(MODEL), train=dict(lr=1e-2, microbatches=MICROBATCHES))
    return losses(cfg, jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh, remat",
    [
        (dict(pipeline=4, fsdp=2), {}),
        (
            dict(
                pipeline=2,
                tensor=2,
                fsdp=2,
                sequence_parallel=True,
                pipeline_microbatches=2,
                pipeline_stage_layers=[1, 3],
            ),
            {},
        ),  # 2 passes
        (dict(pipeline=2, fsdp=2, sequence=2, pipeline_schedule="1f1b", pipeline_stage_layers=[3, 1]), {}),
        (
            dict(
                pipeline=2, tensor=2, fsdp=2, sequence_parallel=True, pipeline_microbatches=2, pipeline_schedule="1f1b"
            ),
            {},
        ),
        (dict(pipeline=2, pipeline_repeats=2, fsdp=2, pipeline_schedule="1f1b"), dict(policy="full")),
    ],
    ids=[
        "pipeline4xfsdp2",
        "pipeline2xtensor2-sp-two-passes-uneven",
        "1f1b-pipeline2xfsdp2xsequence2-uneven",
        "1f1b-pipeline2xtensor2-sp-two-passes",
        "1f1b-pipeline2-repeats2-remat-full",
    ],
)
def test_pipelined_losses_match_one_device(mesh, remat, one_device):
    """First 5 losses (fp32, packed documents) within 1e-5 relative of one device, under both schedules."""
    cfg = tiny_config(
        model=dataclasses.asdict(MODEL), train=dict(lr=1e-2, microbatches=MICROBATCHES), mesh=mesh, remat=remat
    )
    devices = int(np.prod([v for k, v in mesh.items() if k in ("pipeline", "fsdp", "tensor", "sequence")]))
    np.testing.assert_allclose(losses(cfg, jax.devices()[:devices]), one_device, rtol=1e-5)


def test_storage_order_gives_each_stage_its_groups_and_inverts():
    layers = {"layers": np.arange(8)}  # 8 layers, 2 stages x 2 repeats: groups of 2
    stored = to_storage_order(layers, LayerOrder(2, 2))["layers"]
    # stage 0 holds groups 0 and 2 (layers 0-1, 4-5), stage 1 groups 1 and 3
    assert stored.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert to_natural_order({"layers": stored}, LayerOrder(2, 2))["layers"].tolist() == list(range(8))
    assert to_storage_order(layers, LayerOrder(4, 1))["layers"].tolist() == list(range(8))  # natural
    # Uneven: 3 and 5 layers in 5 slots each; the empty slots are zeros (layer 0 is 0 too: count from 1).
    uneven = LayerOrder(2, 1, (3, 5))
    stored = to_storage_order({"layers": np.arange(1, 9, dtype=np.int32)}, uneven)["layers"]
    assert stored.tolist() == [1, 2, 3, 0, 0, 4, 5, 6, 7, 8]
    moved = relayout({"layers": stored}, uneven, LayerOrder(2, 2), jit=False)["layers"]
    assert moved.tolist() == [1, 2, 5, 6, 3, 4, 7, 8]


@pytest.mark.parametrize("stages, repeats, microbatches", [(4, 1, 8), (4, 2, 8), (3, 3, 6), (16, 1, 16)])
def test_1f1b_tables_keep_the_dependencies_and_at_most_2p_micro_batches_in_flight(stages, repeats, microbatches):
    """The tables check every hand-off themselves (one_f_one_b_schedule.schedule); here: each stage's forward and
    backward passes run once per micro-batch and repeat, stage p keeps 2(P - p) - 1 micro-batches at most (R = 1), and
    the loop's iterations give the bubble of the formula."""
    tables = one_f_one_b_schedule.schedule(stages, repeats, microbatches)
    for table in (tables.forward, tables.backward):
        assert (table[..., one_f_one_b_schedule.VALID].sum(axis=0) == microbatches * repeats).all()
    if repeats == 1:
        assert tables.in_flight == tuple(min(2 * (stages - p) - 1, microbatches) for p in range(stages))
    assert tables.iterations == one_f_one_b_schedule.iterations(stages, repeats, microbatches)
    assert one_f_one_b_schedule.compiled_bubble(stages, repeats, microbatches, tables.iterations) == pytest.approx(
        pipeline.bubble_fraction(stages, microbatches, repeats)
    )
    drained = tables.drain[..., 0] * tables.drain[..., 2]  # every gradient of the embeddings reaches its owner
    assert drained.sum() == microbatches and (drained.sum(axis=0) == microbatches // stages).all()


def test_weight_only_residuals_are_told_apart():
    """A VJP's residuals computed from the weights alone (a weight cast, the weight itself) do not depend on the
    data; the activations do, through a scan's carry too."""

    def residuals(w, x):
        step = lambda x, w: (jnp.tanh(x @ w.astype(jnp.bfloat16).astype(jnp.float32)), None)  # noqa: E731
        return jax.tree.leaves(jax.vjp(lambda w, x: jax.lax.scan(step, x, w)[0], w, x)[1])

    w, x = jnp.ones((3, 4, 4)), jnp.ones((2, 4))
    shapes = [leaf.shape for leaf in residuals(w, x)]
    depends = residuals_lib.data_dependent(residuals, (w,), (x,))
    assert [s for s, d in zip(shapes, depends) if not d] == [(3, 4, 4)]  # the cast weights, stacked by the scan
    assert all(s == (3, 2, 4) for s, d in zip(shapes, depends) if d)


@pytest.fixture(scope="module")
def saved_on_pipeline2x2(tmp_path_factory, corpus):
    """(losses of a straight 8-step run on one device, config of a 4-step run on pipeline=2 with repeats=2
    whose checkpoints hold the layers in its storage order), at a constant learning rate."""
    root = tmp_path_factory.mktemp("pipelined")
    common = dict(model=dataclasses.asdict(MODEL), train=dict(steps=8, min_lr_ratio=1.0, microbatches=MICROBATCHES))
    straight = config_for(root / "straight", corpus, **common, mesh=dict(fsdp=1))
    train_quietly(straight, devices=jax.devices()[:1])
    half = config_for(
        root / "half",
        corpus,
        **{**common, "train": {**common["train"], "steps": 4}},
        mesh=dict(pipeline=2, pipeline_repeats=2, fsdp=2),
    )
    train_quietly(half, devices=jax.devices()[:4])
    return logged_losses(straight.run.dir), half


@pytest.mark.parametrize(
    "mesh",
    [
        dict(pipeline=1, fsdp=1),
        dict(pipeline=4, pipeline_repeats=1, fsdp=2),
        dict(pipeline=2, pipeline_repeats=1, fsdp=2, pipeline_schedule="1f1b", pipeline_stage_layers=[3, 1]),
    ],
    ids=["to-one-device", "to-pipeline4", "to-1f1b-uneven"],
)
def test_a_pipelined_checkpoint_resumes_on_another_layout_with_the_same_losses(mesh, tmp_path, saved_on_pipeline2x2):
    """Saved under GPipe with repeats (layers stored 0-1, 4-5 | 2-3, 6-7); resumed on one device, on 4 stages, and
    under 1F1B on uneven stages (stored 0-2 | 3, two empty places: another length)."""
    expected, half = saved_on_pipeline2x2
    for step in (1, 2, 3, 4):  # the pipelined run itself follows one device
        np.testing.assert_allclose(logged_losses(half.run.dir)[step], expected[step], rtol=1e-5)
    run_dir = tmp_path / "run"
    shutil.copytree(half.run.dir, run_dir)
    moved = dataclasses.replace(
        half,
        run=dataclasses.replace(half.run, dir=str(run_dir)),
        train=dataclasses.replace(half.train, steps=8),
        mesh=dataclasses.replace(half.mesh, **mesh),
    )
    messages = []
    devices = mesh["pipeline"] * mesh["fsdp"]
    train_quietly(moved, devices=jax.devices()[:devices], messages=messages)
    assert f"resumed from {run_dir / 'checkpoints' / '4'}" in messages
    got = logged_losses(run_dir)
    np.testing.assert_allclose([got[s] for s in (5, 6, 7, 8)], [expected[s] for s in (5, 6, 7, 8)], rtol=1e-5)


@pytest.mark.parametrize(
    "stages, microbatches, repeats, per_pass, schedule",
    [(2, 2, 1, 2, "1f1b"), (2, 4, 2, 2, "1f1b"), (4, 8, 1, 8, "gpipe")],
)
def test_plan_reports_the_bubble_of_the_schedule_and_of_the_compiled_loop(
    stages, microbatches, repeats, per_pass, schedule, capsys
):
    """per_pass < microbatches: passes through the pipeline, the gradient accumulated over them. bf16, as on GPUs
    (XLA:CPU once aborted compiling the stages' sums, and converts 16-bit buffers it updates in place)."""
    overrides = [
        "model.n_layers=4",
        f"mesh.pipeline={stages}",
        f"mesh.pipeline_repeats={repeats}",
        "mesh.fsdp=1",
        f"train.microbatches={microbatches}",
        "train.batch_size=16",
        f"mesh.pipeline_microbatches={per_pass}",
        f"mesh.pipeline_schedule={schedule}",
        "model.compute_dtype=bfloat16",
    ]
    devices = jax.devices()[:stages]
    if stages == 4:  # the command, as users run it (on all 8 devices: fsdp fills the rest)
        assert cli.main(["plan", "tiny", *overrides[:3], "mesh.fsdp=2", *overrides[4:], "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
    else:
        cfg = config_lib.load_config("tiny", overrides)
        plan = dataclasses.asdict(make_plan(cfg, sharding.make_mesh(cfg, devices=devices)))
    formula = (stages - 1) / (per_pass * repeats + stages - 1)
    assert plan["mesh"]["pipeline"] == stages and plan["bubble"] == pytest.approx(formula)
    iterations = (
        per_pass * repeats + stages - 1
        if schedule == "gpipe"
        else one_f_one_b_schedule.iterations(stages, repeats, per_pass)
    )
    assert plan["pipeline_iterations"] == iterations  # as compiled, read from the HLO
    assert plan["compiled_bubble"] == pytest.approx(formula)
    assert plan["collective_bytes"]["collective-permute"] > 0
    in_flight = (
        one_f_one_b_schedule.schedule(stages, repeats, per_pass).in_flight
        if schedule == "1f1b"
        else (per_pass,) * stages
    )
    assert plan["schedule"] == schedule and list(plan["in_flight"]) == list(in_flight)
    assert max(plan["stage_bytes"]) == plan["total_bytes"] and len(plan["stage_bytes"]) == stages
    if schedule == "1f1b":  # the last stage keeps fewest in flight: least memory
        assert plan["stage_bytes"][-1] < plan["stage_bytes"][0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["mesh.pipeline=4", "mesh.fsdp=2", "train.microbatches=4", "train.batch_size=8"],
            "model.n_layers (2) must be divisible by mesh.pipeline × mesh.pipeline_repeats (4 × 1)",
        ),
        (
            ["model.n_layers=4", "mesh.pipeline=2", "mesh.pipeline_repeats=4", "mesh.fsdp=4", "train.microbatches=2"],
            "model.n_layers (4) must be divisible by mesh.pipeline × mesh.pipeline_repeats (2 × 4)",
        ),
        (
            ["model.n_layers=4", "mesh.pipeline=4", "mesh.fsdp=2", "train.microbatches=2", "train.batch_size=8"],
            "mesh.pipeline=4 needs train.microbatches to be a multiple of 4",
        ),
        (
            [
                "model.n_layers=4",
                "mesh.pipeline=2",
                "mesh.fsdp=4",
                "train.microbatches=2",
                "mesh.pipeline_microbatches=4",
            ],
            "train.microbatches (2) must be a multiple of mesh.pipeline_microbatches (4)",
        ),
        (["mesh.pipeline=0"], "mesh.pipeline must be positive, got 0"),
        (
            ["model.n_layers=4", "mesh.pipeline=2", "mesh.pipeline_stage_layers=[1,2]"],
            "mesh.pipeline_stage_layers [1, 2] must be positive layer counts adding up to model.n_layers (4); "
            "they add up to 3",
        ),
        (
            ["model.n_layers=4", "mesh.pipeline=2", "mesh.pipeline_stage_layers=[1,1,2]"],
            "mesh.pipeline_stage_layers has 3 entries; it needs one per stage: mesh.pipeline (2) = 2",
        ),
        (
            ["mesh.pipeline=2", "mesh.pipeline_schedule=zb"],
            "mesh.pipeline_schedule must be one of gpipe, 1f1b, got 'zb'",
        ),
    ],
)
def test_bad_pipeline_layouts_exit_2_with_one_line(overrides, message, capsys):
    assert cli.main(["plan", "tiny", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_the_readme_405b_layout_passes_the_mesh_checks():
    """The parallelism guide's dry run on 2,048 nodes of 8 GPUs (16,384): Meta's 16 stages over 126 layers, the
    mesh and batch arithmetic checked without devices."""
    from test_readme import readme_commands

    (command,) = [c for c in readme_commands("launch/slurm.sbatch") if "llama3_405b" in c]
    words = shlex.split(command)
    overrides = [w for w in words if "=" in w and not w.startswith("run.dir")]
    cfg = config_lib.load_config("llama3_405b", overrides)
    devices = 8 * int(words[words.index("--nodes") + 1])
    assert devices == 16_384
    sizes = sharding.mesh_shape(cfg.mesh, devices)
    sharding.check_divisibility(cfg, sizes)  # raises ConfigError, one line, if anything does not divide
    sharding.check_parameter_shapes(cfg, sizes)
    assert sizes == {"pipeline": 16, "data": 16, "fsdp": 8, "sequence": 1, "tensor": 8}
    per_stage = LayerOrder(16, cfg.mesh.pipeline_repeats, tuple(cfg.mesh.pipeline_stage_layers))
    assert per_stage.stage_layers(126).sum(axis=1).tolist() == [7] + [8] * 14 + [7]  # Meta's: first and last lighter
    assert cfg.train.batch_size // (sizes["data"] * sizes["fsdp"]) == cfg.train.microbatches == 16  # one row each
    assert pipeline.bubble_fraction(16, cfg.train.microbatches, cfg.mesh.pipeline_repeats) == pytest.approx(15 / 79)
