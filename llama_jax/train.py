"""The train state, the jitted train and eval steps, and the training loop."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import yaml
from flax import struct
from jax.sharding import Mesh

from llama_jax import config as config_lib
from llama_jax import remat, sharding
from llama_jax.attention import select_implementation
from llama_jax.checkpoint import Checkpointer, latest_checkpoint_step
from llama_jax.config import Config, ConfigError
from llama_jax.data.loader import Batches
from llama_jax.data.pipeline import TrainData, cache_root
from llama_jax.generate import generate
from llama_jax.metrics import MetricsLog, device_peak_flops, mfu
from llama_jax.model import Llama, param_count, train_flops_per_token
from llama_jax.optim import learning_rate, make_optimizer
from llama_jax.report import write_report


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


# ---------------------------------------------------------------------------------------------
# Loss and steps (pure functions of their inputs; jitted by `Trainer`)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-token negative log-likelihood over unmasked targets, and their count, in fp32."""
    logits = logits.astype(jnp.float32)
    # A masked sum rather than a gather: with the vocab split over `tensor` each device sums its
    # own slice and XLA adds the partial sums, instead of gathering the [batch, seq, vocab] logits.
    vocab_ids = jnp.arange(logits.shape[-1], dtype=targets.dtype)
    target_logits = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.sum(nll * mask), jnp.sum(mask)


def loss_terms(params, model: Llama, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])
    return cross_entropy_sum(logits, batch["targets"], batch["loss_mask"])


def make_grad_fn(model: Llama, microbatches: int) -> Callable:
    """(params, batch) -> (mean loss, gradient of the mean loss, token count), accumulating the
    gradient over `microbatches` slices of the batch with a scan."""
    grad_fn = jax.value_and_grad(lambda p, b: loss_terms(p, model, b), has_aux=True)

    def loss_and_grads(params, batch: dict[str, jax.Array]):
        if microbatches == 1:
            (loss_sum, count), grad_sum = grad_fn(params, batch)
        else:
            # Microbatch m takes rows m, m + M, m + 2M, ...: every device's slice of the batch
            # contributes to every microbatch, so no device idles while the others accumulate.
            split = jax.tree.map(lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
                                 .swapaxes(0, 1), batch)

            def accumulate(carry, microbatch):
                (loss_sum, count), grads = grad_fn(params, microbatch)
                return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss_sum, count, grad_sum), _ = jax.lax.scan(accumulate, zeros, split)
        # Sums divided by the token count of the whole batch: the same gradient whatever the
        # number of microbatches, even when they hold different numbers of unmasked tokens.
        count = jnp.maximum(count, 1.0)
        return loss_sum / count, jax.tree.map(lambda g: g / count, grad_sum), count

    return loss_and_grads


def make_train_step(model: Llama, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    microbatches: int) -> Callable:
    loss_and_grads = make_grad_fn(model, microbatches)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads, _ = loss_and_grads(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


# ---------------------------------------------------------------------------------------------
# The compiled pieces for one config on one mesh


@dataclass
class Trainer:
    config: Config
    mesh: Mesh
    model: Llama
    state_shardings: Any
    state_shapes: Any  # ShapeDtypeStructs of the (unboxed) state, traced once in build()
    init_state: Callable
    train_step: Callable
    eval_step: Callable

    @classmethod
    def build(cls, config: Config, mesh: Mesh) -> "Trainer":
        model = Llama(config.model, remat_config=config.remat)
        optimizer = make_optimizer(config.train)
        schedule = learning_rate(config.train)
        rules = sharding.axis_rules(config)
        # Fail on an impossible attention kernel now, not in the middle of tracing the first step.
        select_implementation(config.model.attention, jax.default_backend(), config.model.compute_dtype,
                              config.model.resolved_head_dim)

        def init_state(rng: jax.Array) -> TrainState:
            # The dummy batch only fixes shapes (XLA drops the unused forward pass); one row per
            # batch shard keeps it divisible by the mesh inside the context-parallel shard_map.
            tokens = jnp.zeros((mesh.shape["data"] * mesh.shape["fsdp"], config.train.seq_len), jnp.int32)
            params = model.init(rng, tokens)["params"]
            return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

        # Shapes and logical axis names of the whole state, computed without allocating it; the
        # optimizer moments inherit their parameter's names, so they are sharded alike.
        boxed_shapes = jax.eval_shape(init_state, jax.random.key(0))
        state_shardings = sharding.logical_to_sharding(boxed_shapes, mesh, rules)
        param_shardings = state_shardings.params
        batch_sharding = sharding.batch_sharding(mesh)

        def eval_step(params, batch):
            return loss_terms(params, model, batch)

        return cls(
            config=config, mesh=mesh, model=model, state_shardings=state_shardings,
            # Unboxed without a sharding constraint: these are shapes, and build() may run in a mesh context.
            state_shapes=jax.tree.map(
                lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.LogicallyPartitioned) else x,
                boxed_shapes, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)),
            # The state is created directly in its shards: never materialised whole on one device.
            init_state=jax.jit(lambda rng: nn.meta.unbox(init_state(rng)), out_shardings=state_shardings),
            train_step=jax.jit(make_train_step(model, optimizer, schedule, config.train.microbatches),
                               in_shardings=(state_shardings, batch_sharding),
                               out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=(0,)),
            eval_step=jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding)),
        )

    def activate(self):
        """Context in which the steps may be traced: the mesh and logical rules are visible."""
        return sharding.activate(self.mesh, sharding.axis_rules(self.config))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, e.g. as a target to restore a checkpoint into."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.state_shapes,
                            self.state_shardings)

    def local_rows(self) -> list[int]:
        """The rows of every global batch that this process loads."""
        return sharding.process_rows(self.mesh, self.config.train.batch_size, self.config.train.seq_len)

    def put(self, batch):
        return sharding.put_batch(batch, self.mesh, self.config.train.batch_size, self.config.mesh.load_balance)

    def evaluate(self, params, batches: Batches, n_batches: int) -> float:
        total, count, rows = 0.0, 0.0, self.local_rows()
        for i in range(n_batches):
            loss_sum, n = self.eval_step(params, self.put(batches.batch(i, rows)))
            total, count = total + float(loss_sum), count + float(n)
        return total / max(count, 1.0)


# ---------------------------------------------------------------------------------------------
# The loop


SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "tie_embeddings", "param_dtype")


def check_resumable(config: Config, run_dir: Path) -> None:
    """The checkpoints in run_dir must hold this model: name every field that differs."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    saved = (yaml.safe_load(saved_path.read_text()) or {}).get("model", {})
    current = config_lib.to_dict(config)["model"]
    differ = [f"model.{k} {saved.get(k)} (saved) vs {current[k]}" for k in SHAPE_FIELDS if saved.get(k) != current[k]]
    if differ:
        raise ConfigError(f"{run_dir} holds checkpoints of a different model ({'; '.join(differ)}); "
                          "use another run.dir or the saved model settings")


@dataclass
class Run:
    """Everything a training run needs, built and checked before anything in run.dir is written."""

    config: Config
    trainer: Trainer
    data: TrainData
    start: int  # the step to resume from (0: a new run)

    @classmethod
    def setup(cls, config: Config, mesh: Mesh, data: TrainData) -> "Run":
        """Raises ConfigError or DataError (one line each) on bad input; writes nothing."""
        t, run_dir = config.train, Path(config.run.dir)
        start = latest_checkpoint_step(run_dir)
        if start:
            check_resumable(config, run_dir)
        return cls(config, Trainer.build(config, mesh), data, start)


def train(config: Config, mesh: Mesh, data: TrainData, print_fn: Callable[[str], None] = print) -> dict:
    """Check the input, then train `config` on `data` (resuming from run.dir's newest checkpoint)."""
    return execute(Run.setup(config, mesh, data), print_fn)


def execute(run: Run, print_fn: Callable[[str], None] = print) -> dict:
    """The training loop. Returns a summary with the first and last eval loss, throughput and MFU."""
    config, trainer, data, start = run.config, run.trainer, run.data, run.start
    t, run_dir, mesh = config.train, Path(config.run.dir), trainer.mesh
    wall_start = time.perf_counter()
    if start and start >= t.steps:
        print_fn(f"{run_dir} is already trained to step {start}; raise train.steps to continue")
        return {"run_dir": str(run_dir)}
    eval_batches = min(t.eval_batches, data.val.batches_per_epoch())

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_lib.to_yaml(config))
    n_devices = mesh.devices.size
    peak, peak_source = device_peak_flops(config.model.compute_dtype, cache_root(config.data))
    flops_per_token = train_flops_per_token(config.model, t.seq_len)
    tokens_per_step = t.batch_size * t.seq_len
    print_fn(f"{param_count(config.model) / 1e6:.2f}M parameters on {n_devices} {jax.devices()[0].platform} "
             f"device(s), mesh {dict(mesh.shape)}; peak {peak / 1e9:.1f} GFLOP/s per device ({peak_source})")
    print_fn(remat.describe(config.remat))

    checkpointer = Checkpointer(run_dir, config.checkpoint)
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    try:
        with trainer.activate(), MetricsLog(run_dir, total_steps=t.steps, start_step=start,
                                            tensorboard=config.run.tensorboard, print_fn=print_fn) as log:
            if start:
                state, data_state = checkpointer.restore(start, trainer.abstract_state())
                print_fn(f"resumed from {run_dir / 'checkpoints' / str(start)}")
                if data_state.get("fingerprint") != data.fingerprint:
                    print_fn(f"warning: the data settings or sources changed since step {start} was saved; "
                             "the batches from here on differ from the original run's")
            else:
                state = trainer.init_state(jax.random.key(config.seed))
                summary["initial_eval_loss"] = trainer.evaluate(state.params, data.val, eval_batches)
                log.log({"step": 0, "eval_loss": summary["initial_eval_loss"]})

            throughputs: list[float] = []
            window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
            host_batches = data.train.iterate(start, t.steps, trainer.local_rows(), config.data.loader_threads,
                                              config.data.prefetch)
            for step in range(start, t.steps):
                wait_start = time.perf_counter()
                batch = next(host_batches)
                data_wait += time.perf_counter() - wait_start
                state, metrics = trainer.train_step(state, trainer.put(batch))
                done, window_steps = step + 1, window_steps + 1
                first = done == start + 1
                if first or done % t.log_every == 0 or done == t.steps:
                    metrics = jax.device_get(metrics)
                    elapsed = time.perf_counter() - window_start
                    record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
                    if first:  # this step includes compilation: it says nothing about throughput
                        record.update(tokens_per_s=None, mfu=None, compile_s=elapsed)
                    else:
                        tokens_per_s = window_steps * tokens_per_step / elapsed
                        throughputs.append(tokens_per_s)
                        record.update(tokens_per_s=tokens_per_s, step_time_s=elapsed / window_steps,
                                      mfu=mfu(tokens_per_s * flops_per_token, peak, n_devices),
                                      data_wait_s=data_wait / window_steps)
                    log.log(record)
                    window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
                evaluate_now = t.eval_every > 0 and done % t.eval_every == 0 and done != t.steps
                if evaluate_now or done == t.steps:
                    eval_loss = trainer.evaluate(state.params, data.val, eval_batches)
                    log.log({"step": done, "eval_loss": eval_loss})
                    summary["final_eval_loss"] = eval_loss
                if checkpointer.due(done) or done == t.steps:
                    checkpointer.save(done, state, {"next_step": done, "fingerprint": data.fingerprint})
                if evaluate_now or checkpointer.due(done):
                    window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0

            if throughputs:
                summary["tokens_per_s"] = statistics.median(throughputs)
                summary["mfu"] = mfu(summary["tokens_per_s"] * flops_per_token, peak, n_devices)
    finally:
        checkpointer.close()  # also on errors: a pending asynchronous save is finished, not lost
    if t.sample_tokens and t.steps > start:
        # Outside the mesh context: the prompt's length need not divide the sequence shards.
        summary["sample"] = _sample(trainer, state.params, data.tokenizer, config)
        print_fn(f"sample after {t.steps} steps:\n{summary['sample']}")
        (run_dir / "sample.txt").write_text(summary["sample"] + "\n")
    summary["report"] = str(write_report(run_dir))
    summary["wall_time_s"] = time.perf_counter() - wall_start
    return summary


def _sample(trainer: Trainer, params, tokenizer, config: Config) -> str:
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt = [*bos, *tokenizer.encode(config.train.sample_prompt)]
    new = generate(trainer.model, params, prompt, config.train.sample_tokens, jax.random.key(config.seed),
                   stop_token=tokenizer.eos_id)
    return config.train.sample_prompt + tokenizer.decode(new)

