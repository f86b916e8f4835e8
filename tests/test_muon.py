"""train.optimizer=muon: Muon's update (against optax's Muon, and on every mesh against one device's), which
parameters it takes, and runs with it: resumed bitwise, restored onto another mesh, through the guard, stages,
the decay average, fp8 and a pipeline, and the command line."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import tiny_config
from jax.sharding import PartitionSpec
from test_train import random_batch

from llama_jax import cli
from llama_jax.checkpoint.checkpointer import Checkpointer, Tiers
from llama_jax.config import StageConfig
from llama_jax.distributed import sharding
from llama_jax.model import peft
from llama_jax.model.llama import param_shapes
from llama_jax.perf.hlo_text import parse_module
from llama_jax.planning.plan import make_plan
from llama_jax.training.batches import put_batch
from llama_jax.training.loop import train
from llama_jax.training.metrics import read_metrics
from llama_jax.training.optimizer import (
    MATRIX_INPUT_AXES,
    learning_rate,
    make_optimizer,
    optimizer_labels,
)
from llama_jax.training.program import TrainProgram, optimizer_placements

MUON = dict(optimizer="muon", lr=1e-2)
# The update of the same gradients: clipping, whose global norm sums the shards in another order, left out.
UNCLIPPED = dict(MUON, grad_clip=0.0)


def relative_differences(got, expected) -> dict[str, float]:
    """Per leaf: |got - expected| / |expected| (Frobenius norms)."""
    return {
        jax.tree_util.keystr(path): float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected))
    }


def random_gradients(shapes, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    cfg = tiny_config(train=MUON)
    labels = jax.tree_util.tree_leaves_with_path(optimizer_labels(param_shapes(cfg.model)))
    muon = sorted(jax.tree_util.keystr(path) for path, label in labels if label == "muon")
    assert muon == sorted(
        f"['layers']['{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'attn'}']['{name}']['kernel']"
        for name in MATRIX_INPUT_AXES
    )
    assert {label for path, label in labels if jax.tree_util.keystr(path) not in muon} == {"adamw"}
    # A peft run's optimizer sees its adapters only, and they all stay on AdamW.
    lora = tiny_config(train=MUON, peft=dict(method="lora", targets=["q", "v", "up"]))
    adapters, _ = peft.split(param_shapes(lora.model, lora.peft))
    assert set(jax.tree.leaves(optimizer_labels(adapters))) == {"adamw"}


def test_muon_update_matches_optax_contrib_muon():
    """On one device the hidden matrices' updates are optax.contrib.muon's with Moonshot's RMS scaling, the other
    parameters' our AdamW's, over 3 steps, each compiled as the train step is. Within fp32 rounding, amplified:
    optax keeps the coefficients in its state where ours are constants XLA may move through the matmuls, and the
    iteration multiplies a rounding difference by up to a^5 ~ 480 (1.3e-6 measured; the same momentum through
    both iterations, compiled alike, agrees bit for bit)."""
    cfg = tiny_config(train=dict(MUON, grad_clip=0.0, weight_decay=0.1, warmup_steps=1))
    t = cfg.train
    params = param_shapes(cfg.model)
    labels = optimizer_labels(params)
    numbers = jax.tree_util.tree_map_with_path(
        lambda path, label: (
            optax.contrib.MuonDimensionNumbers(
                reduction_axis=tuple(range(1, 1 + MATRIX_INPUT_AXES[path[-2].key])),
                output_axis=tuple(range(1 + MATRIX_INPUT_AXES[path[-2].key], len(_leaf(params, path).shape))),
            )
            if label == "muon"
            else None
        ),
        labels,
    )
    reference = optax.contrib.muon(
        learning_rate(t), beta=t.muon.momentum, weight_decay=t.weight_decay, consistent_rms=t.muon.rms_scale,
        muon_weight_dimension_numbers=numbers,
    )  # fmt: skip
    ours = make_optimizer(t)
    adamw = make_optimizer(dataclasses.replace(t, optimizer="adamw"))
    values = random_gradients(params, seed=0)
    states = [opt.init(values) for opt in (ours, reference, adamw)]
    for step in range(3):
        grads = random_gradients(params, seed=step + 1)
        (got, states[0]), (want, states[1]), (plain, states[2]) = (
            jax.jit(opt.update)(grads, state, values) for opt, state in zip((ours, reference, adamw), states)
        )
        for path, label in jax.tree_util.tree_leaves_with_path(labels):
            expected = _leaf(want if label == "muon" else plain, path)
            difference = np.abs(np.asarray(_leaf(got, path)) - expected).max() / np.abs(expected).max()
            assert difference < 1e-5, (jax.tree_util.keystr(path), step, difference)
        values = optax.apply_updates(values, got)


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


# Each mesh, and where Muon orthogonalizes the 4 layers' up_proj: the stack split over the axes that divide it.
MESHES = {
    "fsdp": (dict(fsdp=8), None),  # 8 devices, 4 layers: every device orthogonalizes all four
    "tensor": (dict(fsdp=4, tensor=2), ("fsdp",)),
    "sequence": (dict(fsdp=4, sequence=2), ("fsdp",)),
    "pipeline": (dict(pipeline=2, fsdp=4), ("pipeline",)),
    "data-fsdp": (dict(data=2, fsdp=4), ("fsdp",)),
}


def muon_updates(cfg, devices, steps=3):
    """The optimizer's updates of `steps` steps from the same random gradients, on cfg's mesh over `devices`; and
    the compiled update's HLO."""
    mesh = sharding.make_mesh(cfg, devices=devices)
    program = TrainProgram.build(cfg, mesh)
    optimizer = make_optimizer(cfg.train, optimizer_placements(cfg, mesh))
    shardings = program.state_shardings
    update = jax.jit(
        optimizer.update,
        in_shardings=(shardings.params, shardings.opt_state, shardings.params),
        out_shardings=(shardings.params, shardings.opt_state),
    )
    shapes = program.state_shapes.params
    values = jax.device_put(random_gradients(shapes, seed=0), shardings.params)
    state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(values)
    updates = []
    with program.activate():
        for step in range(steps):
            grads = jax.device_put(random_gradients(shapes, seed=step + 1), shardings.params)
            got, state = update(grads, state, values)
            values = optax.apply_updates(values, got)
            updates.append(jax.device_get(got))
        text = update.lower(grads, state, values).compile().as_text()
    return updates, text


@pytest.fixture(scope="module")
def one_device_updates():
    cfg = tiny_config(train=UNCLIPPED, model=dict(n_layers=4), mesh=dict(data=1, fsdp=1))
    return muon_updates(cfg, jax.devices()[:1])[0]


@pytest.mark.parametrize("axes, split", MESHES.values(), ids=MESHES.keys())
def test_muon_update_on_a_mesh_is_one_devices(axes, split, one_device_updates):
    """Each step's update of every parameter within 1e-5 (relative) of one device's, the layers' matrices
    orthogonalized whole: the momentum is moved in and the update out, and no collective runs inside Newton-Schulz
    (a sharded matrix would gather or sum its parts at every matmul).
    Not closer: the momentum going in is the same bit for bit, but XLA compiles the iteration's matmuls into each
    program with its own layouts and loop order, and the polynomial amplifies their rounding: one device's step
    and the same iteration compiled alone differ by 1.2e-6 on these random gradients, the worst mesh from one
    device by 4.8e-6 (docs/configuration.md#the-optimizer-adamw-or-muon)."""
    mesh = dict(data=1, fsdp=1, tensor=1, sequence=1, pipeline=1) | axes
    cfg = tiny_config(
        train=dict(UNCLIPPED, microbatches=2 if axes.get("pipeline") else 1), model=dict(n_layers=4), mesh=mesh
    )
    updates, text = muon_updates(cfg, jax.devices())
    for step, (got, expected) in enumerate(zip(updates, one_device_updates)):
        worst = max(relative_differences(got, expected).items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (step, worst)
    comps, _ = parse_module(text)
    moved = [
        (i.opcode, i.attrs["metadata"].split("/muon/")[1].split('"')[0])
        for c in comps.values()
        for i in c.instrs
        if "/muon/" in i.attrs.get("metadata", "") and i.opcode.startswith(("all-", "collective-"))
    ]
    assert not [(op, name) for op, name in moved if "dot_general" in name or op.startswith("all-reduce")], moved
    placed = optimizer_placements(cfg, sharding.make_mesh(cfg))[("layers", "mlp", "up_proj", "kernel")][0]
    assert placed.spec == PartitionSpec(split, None, None)


def test_uneven_pipeline_stages_split_the_stack_as_stored():
    """Stages of 1 and 3 layers store 2 x 3 slots: the stack's 6 places divide over the 2 stages but not over
    fsdp 2 as well (4 layers would), and the step with Muon runs."""
    cfg = tiny_config(
        train=dict(MUON, microbatches=2),
        model=dict(n_layers=4),
        mesh=dict(pipeline=2, data=2, fsdp=2, tensor=1, sequence=1, pipeline_stage_layers=[1, 3]),
    )
    mesh = sharding.make_mesh(cfg)
    placed = optimizer_placements(cfg, mesh)[("layers", "mlp", "up_proj", "kernel")][0]
    assert placed.spec == PartitionSpec(("pipeline",), None, None)
    program = TrainProgram.build(cfg, mesh)
    batch = jax.tree.map(np.asarray, random_batch(cfg))
    with program.activate():
        state = program.init_state(jax.random.key(0))
        state, metrics = program.train_step(state, put_batch(program, batch))
    assert np.isfinite(float(metrics["loss"]))


def test_plan_counts_the_optimizers_collectives():
    """`plan` gives Muon's resharding apart: the collectives under the optimizer's scope."""
    configs = {
        optimizer: tiny_config(train=dict(optimizer=optimizer), model=dict(n_layers=4), mesh=dict(data=1, fsdp=8))
        for optimizer in ("adamw", "muon")
    }
    plans = {name: make_plan(cfg, sharding.make_mesh(cfg)) for name, cfg in configs.items()}
    assert plans["muon"].optimizer_collective_bytes > 10 * plans["adamw"].optimizer_collective_bytes
    assert plans["muon"].optimizer_collective_bytes <= plans["muon"].collective_total


def muon_run(tmp_path, corpus, name, steps=8, **sections):
    base = dict(
        train=dict(MUON, steps=steps, min_lr_ratio=1.0),
        data=dict(sources=[str(corpus)], cache_dir=str(tmp_path / "cache")),
        checkpoint=dict(every_steps=4, keep=10),
        run=dict(compilation_cache="off"),
        mesh=dict(data=1, fsdp=8),
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    cfg = tiny_config(tmp_path / name, **base)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path / name)))


def step_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


def final_state(cfg, step):
    program, checkpointer = TrainProgram.for_config(cfg), Checkpointer(Tiers(Path(cfg.run.dir)), cfg.checkpoint)
    with program.activate():
        state, _ = checkpointer.restore(step, program.abstract_state())
    checkpointer.close()
    return state


def test_a_muon_run_resumes_bitwise_and_continues_on_another_mesh(tmp_path, corpus):
    straight = muon_run(tmp_path, corpus, "straight")
    train(straight, print_fn=lambda _: None)
    expected, state = step_losses(straight.run.dir), final_state(straight, 8)
    # Killed after step 4's checkpoint: the same mesh resumes it bit for bit, Muon's momentum included.
    resumed = dataclasses.replace(straight, run=dataclasses.replace(straight.run, dir=str(tmp_path / "resumed")))
    shutil.copytree(straight.run.dir, resumed.run.dir)
    shutil.rmtree(Path(resumed.run.dir) / "checkpoints" / "8")
    train(resumed, print_fn=lambda _: None)
    assert [r["loss"] for r in read_metrics(Path(resumed.run.dir) / "metrics.jsonl") if "loss" in r][8:] == [
        expected[s] for s in (5, 6, 7, 8)
    ]
    for a, b in zip(jax.tree.leaves(final_state(resumed, 8)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Restored onto data=2 x tensor=4, it continues within 1e-5.
    moved_dir = tmp_path / "moved"
    shutil.copytree(straight.run.dir, moved_dir, ignore=shutil.ignore_patterns("8", "metrics.jsonl"))
    moved = dataclasses.replace(
        straight,
        run=dataclasses.replace(straight.run, dir=str(moved_dir)),
        mesh=dataclasses.replace(straight.mesh, data=2, fsdp=1, tensor=4),
    )
    messages = []
    train(moved, print_fn=messages.append)
    assert f"resumed from {moved_dir / 'checkpoints' / '4'}" in messages
    got = step_losses(moved_dir)
    np.testing.assert_allclose([got[s] for s in (5, 6, 7, 8)], [expected[s] for s in (5, 6, 7, 8)], rtol=1e-5)


def test_muon_through_the_guard_stages_decay_average_fp8_and_a_pipeline(tmp_path, corpus):
    """A staged run (a batch ramp) with a warmup-stable-decay schedule averaging its decay phase, fp8 projections
    on two pipeline stages, and a NaN step the guard skips: it trains to the end with Muon."""
    cfg = muon_run(
        tmp_path,
        corpus,
        "staged",
        steps=10,
        train=dict(
            schedule="wsd",
            decay_steps=3,
            microbatches=2,
            stages=[StageConfig(start_step=4, batch_size=16)],
        ),
        model=dict(fp8="tensorwise"),
        mesh=dict(pipeline=2, data=1, fsdp=4),
        checkpoint=dict(every_steps=2, average_decay=1),
        inject=dict(nan_steps=[2]),
    )
    messages = []
    summary = train(cfg, print_fn=messages.append)
    assert summary["skipped_steps"] == 1
    assert "warning: step 3 skipped: non-finite loss or gradient norm" in messages
    losses = step_losses(cfg.run.dir)
    assert sorted(losses) == list(range(1, 11)) and all(np.isfinite(v) for s, v in losses.items() if s != 3)
    assert (Path(cfg.run.dir) / "averaged").is_dir()
    assert losses[10] < losses[1]


def test_muon_from_the_command_line_and_its_checkpoints_refused_to_adamw(tmp_path, corpus, capsys):
    """`llama-jax train tiny train.optimizer=muon` trains; continuing its run.dir with AdamW is one line, exit 2,
    nothing written."""
    run_dir = tmp_path / "run"
    args = [
        "train",
        "tiny",
        f"data.sources=[{corpus}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"run.dir={run_dir}",
        "train.steps=4",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "run.tensorboard=false",
    ]
    assert cli.main([*args, "train.optimizer=muon"]) == 0
    capsys.readouterr()
    yaml_text = (run_dir / "config.yaml").read_text()
    assert "optimizer: muon" in yaml_text
    records = (run_dir / "metrics.jsonl").read_text()
    assert cli.main([*args, "train.steps=6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"llama-jax: error: {run_dir} holds the state of train.optimizer=muon, not adamw; continue it with "
        "train.optimizer=muon, or start a new run.dir from its parameters with checkpoint.init_from"
    )
    assert (run_dir / "config.yaml").read_text() == yaml_text and (run_dir / "metrics.jsonl").read_text() == records
    assert json.loads(records.splitlines()[-1])["step"] == 4


def test_the_goodput_projection_prices_muons_smaller_checkpoint():
    """Muon keeps one momentum per hidden matrix where AdamW keeps two: llama3_8b's state is 8.5 bytes per
    parameter, not 12, and the projection's stated save cost shrinks with it."""
    from llama_jax.config import load_config
    from llama_jax.planning.goodput_projection import _stated_costs
    from llama_jax.training.optimizer import state_bytes_per_param

    configs = {o: load_config("llama3_8b", [f"train.optimizer={o}"]) for o in ("adamw", "muon")}
    assert state_bytes_per_param(configs["adamw"]) == 12
    assert state_bytes_per_param(configs["muon"]) == pytest.approx(8.52, abs=0.01)
    saves = {o: _stated_costs(c, gpus=32, gpus_per_host=8)["save_durable_s"] for o, c in configs.items()}
    assert saves["muon"][0] == pytest.approx(saves["adamw"][0] * state_bytes_per_param(configs["muon"]) / 12)
    assert "8.52 B/param state (muon" in saves["muon"][1]
