"""The train step and loop: gradient accumulation, learning, remat, sharding, resume."""

import dataclasses
import importlib.util
import inspect
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_config
from flax import nnx

from llama_jax.checkpoint.checkpointer import Checkpointer, Tiers
from llama_jax.config import RematConfig, load_config
from llama_jax.config.choices import REMAT_POLICIES
from llama_jax.data.loader import model_inputs
from llama_jax.data.streams import open_data
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.model import remat
from llama_jax.model.llama import abstract_model
from llama_jax.training import segments
from llama_jax.training.batches import put_batch
from llama_jax.training.loop import train
from llama_jax.training.metrics import read_metrics
from llama_jax.training.optimizer import learning_rate, make_optimizer, weight_decay_mask
from llama_jax.training.parts import Part
from llama_jax.training.program import TrainProgram
from llama_jax.training.run import Run
from llama_jax.training.step import make_grad_fn


def random_batch(cfg, seed=0, batch=8, seq=32, documents_per_row=3):
    """Packed rows of random tokens with document boundaries (a new one at every token 1) and a loss mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.model.vocab_size, (batch, seq + 1))
    for row in tokens:
        row[np.sort(rng.choice(seq, documents_per_row, replace=False))] = 1  # BOS markers
    index, rows = np.arange(seq + 1), []
    for row in tokens:
        starts = row == 1
        rows.append(
            {
                "tokens": row.astype(np.int32),
                "segment_ids": (np.cumsum(starts) + 1).astype(np.int32),
                "positions": (index - np.maximum.accumulate(np.where(starts, index, 0))).astype(np.int32),
            }
        )
    return {k: jnp.asarray(v) for k, v in model_inputs(rows).items()}


def one_device_mesh(cfg):
    return sharding.make_mesh(cfg, devices=jax.devices()[:1])


def relative_difference(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def tiny_params():
    cfg = tiny_config()
    with sharding.activate(one_device_mesh(cfg)):
        return TrainProgram.build(cfg, one_device_mesh(cfg)).init_state(jax.random.key(0)).params


def test_four_microbatches_give_the_gradient_of_one(tiny_params):
    """Accumulating over 4 microbatches (with unequal token counts) equals one full batch."""
    cfg = tiny_config()
    batch = random_batch(cfg)
    batch["loss_mask"] = batch["loss_mask"].at[:3, :20].set(0.0)  # microbatches hold different token counts
    graph = nnx.graphdef(abstract_model(cfg.model))
    loss_1, grads_1, count_1 = jax.jit(make_grad_fn(graph, 1))(tiny_params, batch)
    loss_4, grads_4, count_4 = jax.jit(make_grad_fn(graph, 4))(tiny_params, batch)
    assert float(count_1) == float(count_4)
    assert float(loss_4) == pytest.approx(float(loss_1), rel=1e-6)
    assert relative_difference(grads_4, grads_1) < 1e-5


REMAT_CASES = [RematConfig(policy=p) for p in REMAT_POLICIES if p != "none"] + [
    RematConfig(policy="full", custom={"mlp_hidden": "save", "query_proj": "offload"}),
    RematConfig(policy="selective", every_n_layers=2),
]


@pytest.mark.parametrize("remat_config", REMAT_CASES, ids=lambda r: f"{r.policy}-{len(r.custom)}-{r.every_n_layers}")
def test_remat_policies_leave_gradients_unchanged(tiny_params, remat_config, monkeypatch):
    """Recomputation changes what is stored, never the numbers (fp32, 1e-6 relative). Offloading is
    forced on, so its device-to-host copies really compile and run on this CPU."""
    monkeypatch.setattr(remat, "host_offload_supported", lambda: True)
    cfg = tiny_config()
    batch = random_batch(cfg, seed=1)
    plain, recomputing = (
        nnx.graphdef(abstract_model(cfg.model, remat_config=r)) for r in (RematConfig(), remat_config)
    )
    _, reference, _ = jax.jit(make_grad_fn(plain, 1))(tiny_params, batch)
    _, grads, _ = jax.jit(make_grad_fn(recomputing, 1))(tiny_params, batch)
    assert relative_difference(grads, reference) < 1e-6


def test_a_tiny_model_overfits_a_fixed_batch():
    """Forty Adam steps on one batch drive its loss from ~ln(vocab) to below 1."""
    cfg = tiny_config(train=dict(steps=40, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0))
    mesh = one_device_mesh(cfg)
    program = TrainProgram.build(cfg, mesh)
    batch = put_batch(program, {k: np.asarray(v) for k, v in random_batch(cfg, seed=2).items()})
    with program.activate():
        state = program.init_state(jax.random.key(0))
        losses = []
        for _ in range(cfg.train.steps):
            state, metrics = program.train_step(state, batch)
            losses.append(float(metrics["loss"]))
    assert losses[0] > 5.0  # ln(320) = 5.77 at init
    assert losses[-1] < 1.0


def first_losses(cfg, devices, steps=4):
    mesh = sharding.make_mesh(cfg, devices=devices)
    program = TrainProgram.build(cfg, mesh)
    losses = []
    with program.activate():
        state = program.init_state(jax.random.key(0))
        for step in range(steps):
            state, metrics = program.train_step(
                state, put_batch(program, {k: np.asarray(v) for k, v in random_batch(cfg, seed=10 + step).items()})
            )
            losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.parametrize("data, fsdp, tensor", [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_training_matches_one_device(data, fsdp, tensor):
    """The same losses (fp32, 1e-5 relative) on meshes of 8 devices as on one."""
    cfg = tiny_config(train=dict(lr=1e-2))
    reference = first_losses(cfg, jax.devices()[:1])
    sharded = tiny_config(train=dict(lr=1e-2), mesh=dict(data=data, fsdp=fsdp, tensor=tensor, sequence=1))
    np.testing.assert_allclose(first_losses(sharded, jax.devices()), reference, rtol=1e-5)


def test_fsdp_shards_parameters_and_optimizer_state():
    cfg = tiny_config(mesh=dict(data=1, fsdp=8, tensor=1, sequence=1))
    program = TrainProgram.build(cfg, sharding.make_mesh(cfg))
    kernel = program.state_shardings.params["layers"]["mlp"]["up_proj"]["kernel"]
    adam_mu = program.state_shardings.opt_state[1][0].mu["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.spec == adam_mu.spec == jax.sharding.PartitionSpec("pipeline", "fsdp", "tensor")


@pytest.mark.parametrize("fp8", ["none", "tensorwise"])
def test_resumed_run_is_bitwise_identical_to_straight_run(fp8, tmp_path, corpus):
    """Losing the last checkpoint and re-running resumes from step 4 and reproduces step 8 bit for bit; with fp8
    projections too (current scaling: the scales are computed from the step's tensors, no state to save)."""
    cfg = tiny_config(
        tmp_path,
        model=dict(fp8=fp8),
        train=dict(steps=8, lr=1e-2),
        data=dict(sources=[str(corpus)], cache_dir=str(tmp_path / "cache")),
        checkpoint=dict(every_steps=4),
    )
    prepared = open_data(cfg, print_fn=lambda _: None)
    mesh = one_device_mesh(cfg)
    run_dir = Path(cfg.run.dir)

    def final_state():
        program, checkpointer = TrainProgram.build(cfg, mesh), Checkpointer(Tiers(run_dir), cfg.checkpoint)
        with program.activate():
            state, data_state = checkpointer.restore(8, program.abstract_state())
        assert data_state == {"next_step": 8, "fingerprint": prepared.fingerprint}
        checkpointer.close()
        return state

    messages = []
    train(cfg, print_fn=lambda _: None, devices=jax.devices()[:1])
    straight = final_state()
    shutil.rmtree(run_dir / "checkpoints" / "8")  # as if killed between steps 4 and 8
    train(cfg, print_fn=messages.append, devices=jax.devices()[:1])
    assert any("resumed from" in m and m.endswith("4") for m in messages)
    resumed = final_state()
    assert int(resumed.step) == 8
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Resuming with another model shape is refused, naming the field, and config.yaml is kept.
    saved = (run_dir / "config.yaml").read_text()
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    with pytest.raises(ConfigError, match=r"model.d_model 64 \(saved\) vs 32"):
        Run.setup(other, mesh, prepared)
    assert (run_dir / "config.yaml").read_text() == saved
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    first_run, second_run = records[:8], records[8:]
    assert [r["step"] for r in second_run] == [5, 6, 7, 8]
    assert [r["loss"] for r in second_run] == [r["loss"] for r in first_run[4:]]


LINEN_RUN = Path(__file__).parent / "golden" / "linen_run"


def test_a_run_the_linen_model_wrote_resumes_under_the_nnx_model(tmp_path):
    """tests/golden/linen_run (made by make_linen_run.py): 4 steps that the model wrote when it was Flax Linen,
    checkpointed at steps 2 and 4. The NNX model reads its step-4 checkpoint (the same parameter paths); without
    it, the run resumes from step 2 and trains steps 3 and 4 to the Linen run's losses and step-4 state (bit for
    bit on the Intel Xeon that wrote it; within 1e-6 elsewhere, where a CPU's kernels may add in another order);
    and its own checkpoint of step 3 resumes to its step 4 bit for bit."""
    shutil.copytree(LINEN_RUN, tmp_path / "linen_run")
    run_dir, store = tmp_path / "linen_run" / "run", tmp_path / "linen_run" / "store"
    spec = importlib.util.spec_from_file_location("make_linen_run", LINEN_RUN.parent / "make_linen_run.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    overrides = [f"data.sources=[{store}]", f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(maker.TRAIN[0], [*maker.TRAIN[1:], *overrides, "checkpoint.every_steps=1", "checkpoint.keep=4"])
    devices = jax.devices()[:1]

    def state_at(step):
        program, checkpointer = TrainProgram.for_config(cfg, devices), Checkpointer(Tiers(run_dir), cfg.checkpoint)
        with program.activate():
            state = checkpointer.restore(step, program.abstract_state())[0]
        checkpointer.close()
        return jax.tree.map(np.asarray, state)

    linen = state_at(4)
    shutil.rmtree(run_dir / "checkpoints" / "4")
    messages = []
    train(cfg, print_fn=messages.append, devices=devices)
    assert f"resumed from {run_dir / 'checkpoints' / '2'}" in messages
    resumed = state_at(4)
    assert relative_difference(resumed, linen) < 1e-6
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    linen_losses, nnx_losses = [r["loss"] for r in records[2:4]], [r["loss"] for r in records[4:]]
    assert [r["step"] for r in records[4:]] == [3, 4]
    assert np.allclose(nnx_losses, linen_losses, rtol=1e-6, atol=0), (nnx_losses, linen_losses)
    shutil.rmtree(run_dir / "checkpoints" / "4")
    train(cfg, print_fn=messages.append, devices=devices)
    assert f"resumed from {run_dir / 'checkpoints' / '3'}" in messages
    for a, b in zip(jax.tree.leaves(state_at(4)), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)


def test_weight_decay_skips_embeddings_and_norms(tiny_params):
    cfg = tiny_config(train=dict(weight_decay=0.5, warmup_steps=0))
    optimizer = make_optimizer(cfg.train)
    zero_grads = jax.tree.map(jnp.zeros_like, tiny_params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(tiny_params), tiny_params)
    after = optax.apply_updates(tiny_params, updates)  # a step with zero gradient: only decay moves params
    np.testing.assert_array_equal(after["embed"]["embedding"], tiny_params["embed"]["embedding"])
    np.testing.assert_array_equal(after["final_norm"]["scale"], tiny_params["final_norm"]["scale"])
    assert not np.array_equal(after["lm_head"]["kernel"], tiny_params["lm_head"]["kernel"])
    mask = weight_decay_mask(cfg.train)(tiny_params)
    assert mask["embed"]["embedding"] is False
    assert mask["final_norm"]["scale"] is False and mask["layers"]["attn_norm"]["scale"] is False
    assert mask["layers"]["attn"]["q_proj"]["kernel"] is True and mask["lm_head"]["kernel"] is True
    decayed = tiny_config(train=dict(decay_embeddings=True, decay_norms=True))
    assert all(jax.tree.leaves(weight_decay_mask(decayed.train)(tiny_params)))


def test_learning_rate_warms_up_linearly_then_decays_to_the_floor():
    cfg = tiny_config(train=dict(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    schedule = learning_rate(cfg.train)
    assert float(schedule(0)) == pytest.approx(1e-3 / 11)  # the first step already learns
    assert float(schedule(5)) == pytest.approx(1e-3 / 11 + (1e-3 - 1e-3 / 11) * 5 / 10)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(55)) < 1e-3
    assert float(schedule(100)) == pytest.approx(1e-4)


def test_the_host_reads_each_step_after_dispatching_the_next(tmp_path, corpus, monkeypatch):
    """The devices never wait for the host between steps: after dispatching step n the loop places batch n + 1
    and then reads step n - 1's metrics, the step's only device-to-host transfer. A step that is saved is read
    before its save (its verdict may roll back); every step is logged."""
    cfg = tiny_config(
        tmp_path,
        train=dict(steps=8),
        checkpoint=dict(every_steps=4),
        data=dict(sources=[str(corpus)], cache_dir=str(tmp_path / "cache")),
    )
    events, metric_steps, kept = [], {}, []  # id of a metrics array -> the step that made it
    array_type = type(jnp.zeros(()))
    value = array_type._value  # every device-to-host read of a jax.Array goes through it (np.asarray, float, ...)

    def counted_value(array):
        events.append(("read", metric_steps.get(id(array), "other")))
        return value.fget(array)

    def setup(cls, *args, **kwargs):
        run = real_setup(cls, *args, **kwargs)
        step_fn = run.program.train_step

        def dispatch(state, batch):
            state, metrics = step_fn(state, batch)
            step = sum(e[0] == "dispatch" for e in events) + 1
            metric_steps.update({id(a): step for a in metrics.values()})
            kept.append(metrics)  # alive, so no other array reuses their ids
            events.append(("dispatch", step))
            return state, metrics

        run.program.train_step = dispatch
        return run

    def placed(program, batch):
        events.append(("put", None))
        return put_batch(program, batch)

    real_setup = Run.setup.__func__
    monkeypatch.setattr(Run, "setup", classmethod(setup))
    monkeypatch.setattr(array_type, "_value", property(counted_value))
    monkeypatch.setattr(segments, "put_batch", placed)  # where the loop places its batches
    train(cfg, print_fn=lambda _: None, devices=jax.devices()[:1])
    loop = events[next(i for i, e in enumerate(events) if e[0] == "dispatch") :]

    def after_dispatching(n):  # the events after dispatching step n, up to dispatching step n + 1
        start = loop.index(("dispatch", n))
        end = loop.index(("dispatch", n + 1)) if ("dispatch", n + 1) in loop else len(loop)
        return loop[start + 1 : end]

    put, metrics_of = [("put", None)], lambda n: [("read", n)] * 4  # loss, grad_norm, lr, finite
    for n in (2, 3, 6, 7):  # steady state: place the next batch, then read the step before
        assert after_dispatching(n) == put + metrics_of(n - 1), n
    assert after_dispatching(4) == put + metrics_of(3) + metrics_of(4)  # saved: read before the save
    assert after_dispatching(8)[:8] == metrics_of(7) + metrics_of(8)  # the last step: then saved and evaluated
    assert ("read", "other") not in loop[: loop.index(("dispatch", 8))]  # no other transfer while training
    records = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))


# The example of docs/architecture.md ("Add a part to the loop"), word for word.
class EveryThird(Part):
    def __init__(self):
        self.losses, self.asked, self.acted = {}, [], []

    def observe(self, result):  # every step's result, in order, once the host reads it
        self.losses[result.step] = result.metrics["loss"]
        return result

    def due(self, step, read, stopping):  # asked after every step is dispatched
        self.asked.append(step)
        return step % 3 == 0

    def act(self, at):  # that step's result was read and stands; its state is in hand
        self.acted.append((at.step, int(at.state.step), at.step in self.losses))


def test_a_part_added_to_the_loop_sees_every_step_and_acts_when_due(tmp_path, corpus):
    """A part of its own (training/parts.py) in a few lines, as the guide shows it: it observes each step's result in
    order, is asked after every step, and acts after the steps it is due after, with that step's state in hand."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert f"```python\n{inspect.getsource(EveryThird)}```" in guide
    cfg = tiny_config(tmp_path, train=dict(steps=7), data=dict(sources=[str(corpus)], cache_dir=str(tmp_path / "c")))
    part = EveryThird()
    train(cfg, print_fn=lambda _: None, devices=jax.devices()[:1], parts=[part])
    assert part.asked == list(range(1, 8))
    assert part.acted == [(3, 3, True), (6, 6, True)]  # its result was read (and stood) before it acted
    logged = {r["step"]: r["loss"] for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r}
    assert part.losses == logged
