"""The train state, the jitted train and eval steps, and the training loop."""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from llama_jax import config as config_lib
from llama_jax import api, remat, sharding
from llama_jax.attention import select_implementation, skips_masked_blocks
from llama_jax.checkpoint import Checkpointer, check_model, latest_checkpoint_step, read_meta, resolve_step_dir, \
    restore_step
from llama_jax.config import Config, ConfigError
from llama_jax.data.loader import Batches
from llama_jax.data.pipeline import TrainData, cache_root
from llama_jax.generate import sample_text
from llama_jax.metrics import MetricsLog, device_peak_flops, mfu
from llama_jax.model import Llama, param_count, train_flops_per_token
from llama_jax.optim import learning_rate, make_optimizer
from llama_jax.report import write_report
from llama_jax.resilience import EXIT_PREEMPTED, Goodput, HangWatchdog, PreemptionGuard, SpikeGuard, \
    StragglerDetector, auto_checkpoint_steps, format_goodput, interval_advice, observed_mtbf_s

DEFAULT_MTBF_S = 3 * 3600.0  # Llama 3 405B: one interruption every ~3 h on 16k GPUs (a big-run figure)


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
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient skips the update: params and optimizer moments stay as they
        # were (so a NaN never reaches a checkpoint); the step still counts, the data moves on.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "finite": finite}
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
                              config.model.resolved_head_dim, config.train.seq_len)

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


@dataclass
class Run:
    """Everything a training run needs, built and checked before anything in run.dir is written."""

    config: Config
    trainer: Trainer
    data: TrainData
    start: int  # the newest checkpoint step in run.dir (0: none)
    source: str | None = None  # checkpoint.resume_from / init_from, for a new run.dir

    @classmethod
    def setup(cls, config: Config, mesh: Mesh, data: TrainData) -> "Run":
        """Raises ConfigError or DataError (one line each) on bad input; writes nothing."""
        run_dir, model = Path(config.run.dir), config_lib.to_dict(config)["model"]
        start, source = latest_checkpoint_step(run_dir), None
        if start:
            meta = read_meta(run_dir / "checkpoints" / str(start))
            if meta is not None:  # an unreadable one is set aside at restore time
                check_model(meta["config"]["model"], model, run_dir)
        elif config.checkpoint.resume_from or config.checkpoint.init_from:
            source = config.checkpoint.resume_from or config.checkpoint.init_from
            if config.checkpoint.resume_from and (api.hf_directory(source) or
                                                  (resolve_step_dir(source) / "params").is_dir()):
                raise ConfigError(f"{source} holds parameters only (no optimizer state or data position) and "
                                  "cannot be resumed; start from it with checkpoint.init_from")
            check_model(dataclasses.asdict(api.model_config(source)), model, source)
        return cls(config, Trainer.build(config, mesh), data, start, source)


def train(config: Config, mesh: Mesh, data: TrainData, print_fn: Callable[[str], None] = print) -> dict:
    """Check the input, then train `config` on `data` (resuming from run.dir's newest checkpoint)."""
    return execute(Run.setup(config, mesh, data), print_fn)


def enable_compilation_cache(config: Config) -> None:
    """JAX's persistent compilation cache: a restarted run loads its compiled steps instead of compiling."""
    setting = config.run.compilation_cache
    if setting == "off":
        return
    directory = Path(setting).expanduser() if setting else cache_root(config.data) / "jax_compilation_cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))


def model_flops_per_token(config: Config) -> float:
    """train_flops_per_token for the attention kernel this config runs (context parallelism uses XLA's)."""
    m = config.model
    kernel = select_implementation(m.attention, jax.default_backend(), m.compute_dtype, m.resolved_head_dim,
                                   config.train.seq_len)
    return train_flops_per_token(m, config.train.seq_len, skips_masked_blocks(kernel) and config.mesh.sequence == 1)


def run_metadata(config: Config, mesh: Mesh) -> dict:
    from llama_jax import __version__

    return {"config": config_lib.to_dict(config), "llama_jax": __version__, "jax": jax.__version__,
            "mesh": dict(mesh.shape), "processes": jax.process_count(), "devices": mesh.devices.size}


def _injected_hang() -> None:
    """fault.inject_hang_step: stand-in for a collective that never returns."""
    while True:
        time.sleep(3600)


def _restore(run: Run, checkpointer: Checkpointer, print_fn) -> tuple[TrainState | None, int]:
    """(state, data position) from run.dir's newest good checkpoint, resume_from or init_from; (None, 0) if new."""
    trainer, abstract = run.trainer, run.trainer.abstract_state()
    if run.start:
        model = config_lib.to_dict(run.config)["model"]
        found = checkpointer.restore_newest(abstract, model, print_fn)
        if found:
            step, state, data_state = found
            print_fn(f"resumed from {checkpointer.directory / str(step)}")
            if data_state.get("fingerprint") != run.data.fingerprint:
                print_fn(f"warning: the data settings or sources changed since step {step} was saved; "
                         "the batches from here on differ from the original run's")
            return state, int(data_state["next_step"])
        print_fn("warning: no checkpoint in run.dir restores; starting from scratch")
    if run.source is not None and run.config.checkpoint.resume_from:
        state, data_state = restore_step(resolve_step_dir(run.source), abstract)
        print_fn(f"resumed from {run.source}")
        return state, int(data_state["next_step"])
    if run.source is not None:
        _, params = api.load(run.source, compute_dtype=None, target=abstract.params)
        print_fn(f"initialised the params from {run.source}")
        return trainer.init_state(jax.random.key(run.config.seed)).replace(params=params), 0
    return None, 0


def execute(run: Run, print_fn: Callable[[str], None] = print, started_at: float | None = None) -> dict:
    """The training loop. Returns a summary: eval losses, throughput, MFU, goodput and the exit code
    (0, or EXIT_PREEMPTED after a SIGTERM/SIGINT made it save and stop)."""
    config, trainer, data = run.config, run.trainer, run.data
    t, f, run_dir, mesh = config.train, config.fault, Path(config.run.dir), trainer.mesh
    started_at = started_at or time.time()
    wall_start = time.perf_counter()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "exit_code": 0}
    if run.start and run.start >= t.steps:
        print_fn(f"{run_dir} is already trained to step {run.start}; raise train.steps to continue")
        return summary
    enable_compilation_cache(config)
    multi, primary = jax.process_count() > 1, jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if primary:
        (run_dir / "config.yaml").write_text(config_lib.to_yaml(config))
        data.tokenizer.save(run_dir)  # `llama-jax generate` and `eval` find the run's tokenizer here
    n_devices = mesh.devices.size
    peak, peak_source = device_peak_flops(config.model.compute_dtype, cache_root(config.data))
    flops_per_token = model_flops_per_token(config)
    tokens_per_step = t.batch_size * t.seq_len
    print_fn(f"{param_count(config.model) / 1e6:.2f}M parameters on {n_devices} {jax.devices()[0].platform} "
             f"device(s), mesh {dict(mesh.shape)}; peak {peak / 1e9:.1f} GFLOP/s per device ({peak_source})")
    print_fn(remat.describe(config.remat))

    checkpointer = Checkpointer(run_dir, config.checkpoint, meta=run_metadata(config, mesh))
    goodput = Goodput(run_dir, started_at, write=primary)
    guard = SpikeGuard(f.max_bad_steps, f.spike_zscore, f.spike_window)
    stragglers = StragglerDetector(f.straggler_factor)
    host = socket.gethostname() + (f"-p{jax.process_index()}" if multi else "")
    watchdog = HangWatchdog(run_dir, host, factor=f.hang_factor, min_timeout_s=f.hang_min_timeout_s,
                            startup_timeout_s=f.hang_startup_timeout_s,
                            describe=lambda: _collective_summary(config, mesh))
    preemption = PreemptionGuard(checkpointer.manager.reached_preemption if multi else None)
    auto_interval = config.checkpoint.every_steps == "auto"
    mtbf_s = config.checkpoint.mtbf_hours * 3600 or observed_mtbf_s(run_dir) or DEFAULT_MTBF_S
    try:
        with watchdog, preemption, trainer.activate(), MetricsLog(
                run_dir, total_steps=t.steps, start_step=run.start, tensorboard=config.run.tensorboard,
                print_fn=print_fn, enabled=primary) as log:
            with watchdog.paused("restore"):
                restore_start = time.perf_counter()
                state, data_step = _restore(run, checkpointer, print_fn)
            if state is not None:
                goodput.add("checkpoint_restore", time.perf_counter() - restore_start)
            else:
                state = trainer.init_state(jax.random.key(config.seed))
            step = int(state.step)
            goodput.begin(step)
            eval_batches = min(t.eval_batches, data.val.batches_per_epoch())
            if step == 0:
                with watchdog.paused("eval"):
                    summary["initial_eval_loss"] = trainer.evaluate(state.params, data.val, eval_batches)
                log.log({"step": 0, "eval_loss": summary["initial_eval_loss"]})

            host_batches = data.train.iterate(data_step, data_step + 10**12, trainer.local_rows(),
                                              config.data.loader_threads, config.data.prefetch)
            window = {"steps": 0, "seconds": 0.0, "data_wait": 0.0}
            throughputs: list[float] = []
            first_step, last_done, stalled = step + 1, time.perf_counter(), 0.0
            while step < t.steps:
                if data_step == f.inject_hang_step:
                    _injected_hang()
                wait_start = time.perf_counter()
                batch = next(host_batches)
                waited = time.perf_counter() - wait_start
                if data_step in f.inject_nan_steps:
                    batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
                state, metrics = trainer.train_step(state, trainer.put(batch))
                step, data_step = step + 1, data_step + 1
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                done = time.perf_counter()
                seconds, last_done = done - last_done, done
                goodput.add("data_wait", waited)
                if step == first_step:  # compilation happens here; the step time says nothing
                    goodput.add("compile", seconds - waited - stalled)
                    watchdog.step_done(step, None)
                else:
                    goodput.step_done(step, seconds - waited - stalled)
                    watchdog.step_done(step, seconds - stalled)
                    window["steps"] += 1
                    window["seconds"] += seconds - stalled
                    window["data_wait"] += waited
                    warning = stragglers.observe(step, seconds - stalled, process=jax.process_index())
                    if warning:
                        print_fn(warning)
                stalled = 0.0
                verdict = guard.observe(step, metrics["loss"], bool(metrics.pop("finite")))
                if verdict == "skipped":
                    print_fn(f"warning: step {step} skipped: non-finite loss or gradient norm")
                elif verdict == "spike":
                    print_fn(f"warning: step {step} loss spike: {metrics['loss']:.4f}")
                if verdict == "rollback":
                    with watchdog.paused("rollback"):
                        state, step = _roll_back(checkpointer, trainer, state, step, data_step, guard, goodput, print_fn)
                    last_done = time.perf_counter()
                    continue

                if step == first_step or step % t.log_every == 0 or step == t.steps:
                    record = {"step": step, **metrics, "skipped_total": guard.bad_steps_total}
                    if window["steps"]:
                        per_step = window["seconds"] / window["steps"]
                        tokens_per_s = tokens_per_step / per_step
                        throughputs.append(tokens_per_s)
                        record.update(tokens_per_s=tokens_per_s, step_time_s=per_step,
                                      mfu=mfu(tokens_per_s * flops_per_token, peak, n_devices),
                                      data_wait_s=window["data_wait"] / window["steps"])
                    else:
                        record.update(tokens_per_s=None, mfu=None, compile_s=seconds)
                    log.log(record)
                    goodput.flush()
                    window = {"steps": 0, "seconds": 0.0, "data_wait": 0.0}

                pause_start = time.perf_counter()
                evaluate_now = t.eval_every > 0 and step % t.eval_every == 0 and step != t.steps
                if evaluate_now or step == t.steps:
                    with watchdog.paused("eval"):
                        eval_loss = trainer.evaluate(state.params, data.val, eval_batches)
                    log.log({"step": step, "eval_loss": eval_loss})
                    summary["final_eval_loss"] = eval_loss
                    goodput.add("eval", time.perf_counter() - pause_start)
                stop = preemption.should_stop(step)
                if _save_due(checkpointer, step, multi) or step == t.steps or stop:
                    save_start = time.perf_counter()
                    with watchdog.paused("checkpoint"):
                        checkpointer.save(step, state, {"next_step": data_step, "fingerprint": data.fingerprint})
                        if auto_interval and len(checkpointer.save_seconds) == 1:
                            save_s = checkpointer.save_seconds[0] + checkpointer.wait()  # the first, in full
                            step_s = tokens_per_step / statistics.median(throughputs) if throughputs else 1.0
                            checkpointer.every_steps = auto_checkpoint_steps(save_s, mtbf_s, step_s)
                            print_fn(interval_advice(save_s, mtbf_s, step_s, checkpointer.every_steps, auto=True))
                    goodput.add("checkpoint_save", time.perf_counter() - save_start)
                if stop:
                    print_fn(f"{preemption.signal_name or 'preemption'} received: saved step {step}, stopping "
                             f"(exit {EXIT_PREEMPTED}); re-run the same command to continue")
                    summary["exit_code"] = EXIT_PREEMPTED
                    break
                stalled = time.perf_counter() - pause_start

            if throughputs:
                summary["tokens_per_s"] = statistics.median(throughputs)
                summary["mfu"] = mfu(summary["tokens_per_s"] * flops_per_token, peak, n_devices)
            with watchdog.paused("final save"):
                goodput.add("checkpoint_save", checkpointer.wait())
            summary["goodput"] = goodput.summary()
            summary["skipped_steps"] = guard.bad_steps_total
            log.log({"step": step, **{f"goodput_{k}": v for k, v in summary["goodput"].items()}})
            goodput.finish(preempted=summary["exit_code"] == EXIT_PREEMPTED)
            print_fn(format_goodput(summary["goodput"]))
            if checkpointer.save_seconds and throughputs:
                print_fn(interval_advice(statistics.median(checkpointer.save_seconds), mtbf_s,
                                         tokens_per_step / summary["tokens_per_s"], checkpointer.every_steps))
    finally:
        checkpointer.close()  # also on errors: a pending asynchronous save is finished, not lost
    if t.sample_tokens and summary["exit_code"] == 0 and step > run.start:
        # Outside the mesh context: the prompt's length need not divide the sequence shards.
        summary["sample"] = sample_text(config, state.params, data.tokenizer)
        print_fn(f"sample after {t.steps} steps:\n{summary['sample']}")
        if primary:
            (run_dir / "sample.txt").write_text(summary["sample"] + "\n")
    if primary:
        summary["report"] = str(write_report(run_dir))
    summary["wall_time_s"] = time.perf_counter() - wall_start
    return summary


def _collective_summary(config: Config, mesh: Mesh) -> str:
    """For hang dumps: what the compiled step communicates (from the persistent cache when warm)."""
    from llama_jax.plan import format_plan, make_plan  # plan imports this module

    return format_plan(make_plan(config, mesh))


def _save_due(checkpointer: Checkpointer, step: int, multi: bool) -> bool:
    due = checkpointer.due(step)
    if multi and checkpointer.config.every_minutes > 0:  # clocks differ: process 0 decides for all
        from jax.experimental import multihost_utils

        due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
    return due


def _roll_back(checkpointer, trainer, state, step, data_step, guard, goodput, print_fn):
    """After max_bad_steps bad steps in a row: back to the newest checkpoint, skipping the batches since."""
    checkpointer.wait()
    steps = checkpointer.manager.all_steps()
    if not steps:
        print_fn(f"warning: {guard.consecutive} bad steps in a row at step {step} and no checkpoint to roll back to")
        guard.reset()
        return state, step
    back, _ = checkpointer.restore(max(steps), trainer.abstract_state())
    back_step = int(back.step)
    goodput.discard(back_step, step)
    print_fn(f"warning: {guard.consecutive} bad steps in a row: rolled back from step {step} to {back_step}; "
             f"the data continues at batch {data_step}, skipping the {step - back_step} batches since")
    guard.reset()
    return back, back_step


def load_checkpoint(config: Config, step: int, devices=None) -> tuple[TrainState, dict]:
    """(train state, loader state) saved at `step` in config.run.dir, restored onto `devices` (default:
    all) in config's mesh: to inspect a run's parameters or compare two runs."""
    trainer = Trainer.build(config, sharding.make_mesh(config, devices=devices))
    checkpointer = Checkpointer(Path(config.run.dir), config.checkpoint)
    try:
        with trainer.activate():
            return checkpointer.restore(step, trainer.abstract_state())
    finally:
        checkpointer.close()
