"""The train state, the loss, and the compiled programs of one config on one mesh.

A TrainProgram is what training, evaluation, `plan`, `tune` and the benchmarks all build (with
`TrainProgram.for_config(config)`, or `build(config, mesh)` on a mesh they already have): the model, the
state's shardings, and three jitted functions (init, train step, eval step) whose inputs and outputs are
placed by the logical-axis table of sharding.py. It chooses what the model is traced for, its TraceContext
(model/context.py): the mesh's platform, the mesh and that table (trace_context).

A peft run (peft.method != none) trains adapters on a frozen base model: its state is a PeftState, whose
params and optimizer state are the adapters' only, with the base's params beside them, frozen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh

from llama_jax.config import Config
from llama_jax.data.loader import Batches
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.files import format_bytes
from llama_jax.model import jax_workarounds, peft
from llama_jax.model.attention import select_implementation, skips_masked_blocks
from llama_jax.model.context import TraceContext, mesh_device, mesh_platform
from llama_jax.model.flops import matmul_param_count, train_flops_per_token
from llama_jax.model.llama import Llama
from llama_jax.model.params import abstract, is_param
from llama_jax.model.pipeline import PipelineLayout, fewest_microbatches, pass_microbatches
from llama_jax.model.stages import LayerOrder, to_storage_order
from llama_jax.perf import gpu_target
from llama_jax.perf.hardware import compile_only, memory_budget
from llama_jax.training.optimizer import learning_rate, make_optimizer, schedule_count

# The fields of a batch, each [batch, seq]: what the loader yields and the train step takes.
BATCH_FIELDS = {
    "tokens": jnp.int32,
    "targets": jnp.int32,
    "segment_ids": jnp.int32,
    "positions": jnp.int32,
    "loss_mask": jnp.float32,
}


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any  # what learns
    opt_state: Any

    def checkpointed(self) -> TrainState:
        """What a checkpoint of this state holds."""
        return self

    @property
    def model_params(self) -> Any:
        """The params the model runs with."""
        return self.params


class PeftState(TrainState):
    """A peft run's state: params and optimizer state of the adapters only, and the base model's params,
    frozen. The base goes into every step with the rest of the state (donated and returned as it came, so
    XLA aliases its buffers and nothing is copied), but it gets no gradient and no optimizer state, and
    checkpoints leave it out: they reference it (loop.py)."""

    frozen: Any = None

    def checkpointed(self) -> TrainState:
        return TrainState(step=self.step, params=self.params, opt_state=self.opt_state)

    @property
    def model_params(self) -> Any:
        return peft.merge(self.params, self.frozen)


# ---------------------------------------------------------------------------------------------
# Loss and steps (pure functions of their inputs; jitted by TrainProgram)


def loss_terms(
    params, graph: nnx.GraphDef, batch: dict[str, jax.Array], dropout_key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(summed next-token loss, unmasked token count) of one batch, in fp32, by the model of `graph` (nnx.graphdef
    of a Llama) with `params`. A dropout key (training a peft run with peft.dropout) turns LoRA's dropout on."""
    model = nnx.merge(graph, params)
    return model(
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
        targets=batch["targets"],
        loss_mask=batch["loss_mask"],
        dropout_key=dropout_key,
    )


def make_grad_fn(graph: nnx.GraphDef, microbatches: int) -> Callable:
    """(params, batch, frozen, dropout key) -> (mean loss, gradient of the mean loss, token count),
    accumulating the gradient over `microbatches` slices of the batch with a scan. With `frozen` (a peft
    run's base model) the model runs on both, and only `params` (the adapters) are differentiated: no
    weight gradient of the base is ever computed."""

    def loss(params, batch, frozen, key):
        return loss_terms(params if frozen is None else peft.merge(params, frozen), graph, batch, key)

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def loss_and_grads(params, batch: dict[str, jax.Array], frozen=None, key: jax.Array | None = None):
        if microbatches == 1:
            (loss_sum, count), grad_sum = grad_fn(params, batch, frozen, key)
        else:
            # Microbatch m takes rows m, m + M, m + 2M, ...: every device's slice of the batch
            # contributes to every microbatch, so no device idles while the others accumulate.
            split = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1), batch
            )

            def accumulate(carry, microbatch_and_index):
                microbatch, index = microbatch_and_index
                microbatch_key = None if key is None else jax.random.fold_in(key, index)
                (loss_sum, count), grads = grad_fn(params, microbatch, frozen, microbatch_key)
                return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss_sum, count, grad_sum), _ = jax.lax.scan(accumulate, zeros, (split, jnp.arange(microbatches)))
        # Sums divided by the token count of the whole batch: the same gradient whatever the
        # number of microbatches, even when they hold different numbers of unmasked tokens.
        count = jnp.maximum(count, 1.0)
        return loss_sum / count, jax.tree.map(lambda g: g / count, grad_sum), count

    return loss_and_grads


def make_train_step(
    graph: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    microbatches: int,
    dropout_seed: int | None = None,
) -> Callable:
    """The jitted step's function. With dropout_seed, step n's dropout key is (seed, n): a resumed run
    draws the masks a straight run would."""
    loss_and_grads = make_grad_fn(graph, microbatches)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        key = None if dropout_seed is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)
        frozen = state.frozen if isinstance(state, PeftState) else None
        loss, grads, _ = loss_and_grads(state.params, batch, frozen, key)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient skips the update: params and optimizer moments stay as they
        # were (so a NaN never reaches a checkpoint); the step still counts, the data moves on.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), (params, opt_state), (state.params, state.opt_state)
        )
        # The rate this step applies: the optimizer counts only the updates it applied.
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(schedule_count(state.opt_state)),
            "finite": finite,
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


# ---------------------------------------------------------------------------------------------
# The compiled programs of one config on one mesh


def make_init_state(
    make_model: Callable[..., Llama], optimizer: optax.GradientTransformation, config: Config, mesh: Mesh
) -> Callable:
    """rng -> the fresh TrainState (a PeftState for a peft run) of the model make_model(rngs=...) builds, on `mesh`:
    its params (and the optimizer moments that mirror them) nnx.Params carrying their logical axis names."""
    adapting = config.peft.method != "none"

    def init_state(rng: jax.Array) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(make_model(rngs=nnx.Rngs(params=rng)), nnx.Param), lambda v: v)
        if not adapting:
            # Each pipeline stage's layers in one block (stages.py); the natural order without repeats.
            params = to_storage_order(params, layer_order(config, mesh))
            return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
        adapters, base = peft.split(params)  # the optimizer sees the adapters only: no state for the base
        return PeftState(
            step=jnp.zeros((), jnp.int32), params=adapters, opt_state=optimizer.init(adapters), frozen=base
        )

    return init_state


@dataclass
class TrainProgram:
    config: Config
    mesh: Mesh
    model: Llama  # abstract (params.abstract): the model's graph and shapes, traced for this program's context
    graph: nnx.GraphDef  # the model split once: what the jitted steps merge with the params they are given
    state_shardings: Any
    state_shapes: Any  # ShapeDtypeStructs of the (unboxed) state, traced once in build()
    init_state: Callable  # rng -> a new state (a peft run's base too: random, for benchmarks and tests)
    init_trained: Callable  # rng -> a new state's checkpointed() part (a peft run: the adapters and their moments)
    train_step: Callable
    eval_step: Callable  # (model params, batch) -> (summed loss, token count)
    compiled_step: Any = None  # the train step compiled ahead of time (compile_step); calls of train_step reuse it

    @classmethod
    def for_config(cls, config: Config, devices=None) -> TrainProgram:
        """On config's mesh over `devices` (default: all). Raises ConfigError for a mesh that cannot work."""
        return cls.build(config, sharding.make_mesh(config, devices=devices))

    @classmethod
    def build(cls, config: Config, mesh: Mesh, context: TraceContext | None = None) -> TrainProgram:
        """The programs of `config` on `mesh`, traced for `context` (default: trace_context(config, mesh));
        train.microbatches=auto compiles the step for each count in turn and keeps the first that fits the
        memory budget."""
        context = context or trace_context(config, mesh)
        if config.train.microbatches == "auto":
            return cls._fewest_microbatches_that_fit(config, mesh, context)
        layout = pipeline_layout(config, mesh)
        make_model = functools.partial(
            Llama,
            config.model,
            remat_config=config.remat,
            load_balanced=config.mesh.load_balance,
            peft=config.peft,
            pipeline=layout,
            context=context,
        )
        model = abstract(lambda: make_model(rngs=nnx.Rngs(0)))
        graph = nnx.graphdef(model)
        # With pipelining the micro-batches are the pipeline's (inside the model); the step accumulates the
        # gradient over the passes through it, if there are several.
        accumulate = config.train.microbatches // layout.microbatches if layout else config.train.microbatches
        adapting = config.peft.method != "none"
        optimizer = make_optimizer(config.train)
        schedule = learning_rate(config.train)
        rules = context.rules
        # Fail on an impossible attention kernel now, not in the middle of tracing the first step.
        select_implementation(
            config.model.attention,
            mesh_platform(mesh),
            config.model.compute_dtype,
            config.model.resolved_head_dim,
            config.train.seq_len,
        )

        init_state = make_init_state(make_model, optimizer, config, mesh)

        # Shapes and logical axis names of the whole state, computed without allocating it; the optimizer moments
        # inherit their parameter's names (nnx.Params, through optax), so they are sharded alike. Traced once: the
        # initialisers below replay this trace's jaxpr instead of building the model again.
        init_jaxpr, boxed_shapes = jax.make_jaxpr(init_state, return_shape=True)(jax.random.key(0))
        replay_init, boxes = jaxpr_as_fun(init_jaxpr), jax.tree.structure(boxed_shapes)
        state_shardings = sharding.logical_to_sharding(boxed_shapes, mesh, rules)
        batch_sharding = sharding.batch_sharding(mesh)

        def eval_step(params, batch):
            return loss_terms(params, graph, batch)

        unboxed = lambda rng: unbox(jax.tree.unflatten(boxes, replay_init(rng)))  # noqa: E731
        dropout_seed = config.seed if adapting and config.peft.dropout > 0 else None

        return cls(
            config=config,
            mesh=mesh,
            model=model,
            graph=graph,
            state_shardings=state_shardings,
            state_shapes=unbox(boxed_shapes),
            # The state is created directly in its shards: never materialised whole on one device.
            init_state=jax.jit(unboxed, out_shardings=state_shardings),
            # Only what it returns is computed: a peft run's base is never initialised here.
            init_trained=jax.jit(lambda rng: unboxed(rng).checkpointed(), out_shardings=state_shardings.checkpointed()),
            train_step=jax.jit(
                make_train_step(graph, optimizer, schedule, accumulate, dropout_seed),
                in_shardings=(state_shardings, batch_sharding),
                out_shardings=(state_shardings, sharding.replicated(mesh)),
                donate_argnums=(0,),
            ),
            eval_step=jax.jit(eval_step, in_shardings=(state_shardings.model_params, batch_sharding)),
        )

    @classmethod
    def _fewest_microbatches_that_fit(cls, config: Config, mesh: Mesh, context: TraceContext) -> TrainProgram:
        """The program with the fewest micro-batches whose compiled step fits the budget; else the most
        (one sequence per device at a time), which check_fits then refuses."""
        rows = config.train.batch_size // (mesh.shape["data"] * mesh.shape["fsdp"])  # per batch shard
        budget = memory_budget(config.run.device_memory_gb, own_device(mesh))
        # pipelining needs a multiple of the stages, and of the micro-batches of one pass
        step = fewest_microbatches(config.mesh, mesh.shape["pipeline"])
        counts = [n for n in range(step, rows + 1) if rows % n == 0 and n % step == 0]
        if not counts:
            raise ConfigError(
                f"train.microbatches=auto: no micro-batch count is a multiple of {step} (the pipeline "
                f"stages and mesh.pipeline_microbatches) and divides the {rows} rows of each batch "
                "shard; raise train.batch_size or lower mesh.pipeline_microbatches"
            )
        failure = None
        for count in counts:
            program = cls.build(
                dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=count)), mesh, context
            )
            try:
                needs = program.memory_bytes()
            except jax.errors.JaxRuntimeError as err:
                # XLA:GPU's HLO verifier rejects some counts of some layouts (jax 0.12.0.1, llama3_405b's long-context
                # stages at 1 micro-batch: an async custom call's shape); another count compiles, so try it.
                failure = err
                continue
            failure = None
            if needs <= budget:
                break
        if failure is not None:
            raise failure
        return program

    def compile_step(self):
        """The train step compiled for the abstract state and batch (once; later calls of train_step reuse it).
        For GPUs that are not here (gpu_target.py) XLA:GPU compiles it under launch/gpu_env.sh's flags."""
        if self.compiled_step is None:
            options = gpu_target.compiler_options() if self.for_gpus_elsewhere else None
            with self.activate():
                lowered = self.train_step.lower(self.abstract_state(), self.abstract_batch())
                self.compiled_step = lowered.compile(compiler_options=options) if options else lowered.compile()
        return self.compiled_step

    @property
    def for_gpus_elsewhere(self) -> bool:
        """Whether the mesh is made of compile-only GPUs (`--target`): planned, never run here."""
        return gpus_elsewhere(self.mesh)

    @property
    def context(self) -> TraceContext:
        """What the model is traced for (model/context.py)."""
        return self.model.context

    def memory_bytes(self) -> int:
        """Per device, what the compiled step needs: step_memory_bytes, plus cuDNN attention's workspace on
        compile-only GPUs, whose compile does not size it (gpu_target.cudnn_workspace_bytes)."""
        return step_memory_bytes(self.compile_step()) + self.cudnn_workspace_bytes()

    def cudnn_workspace_bytes(self) -> int:
        """The part of memory_bytes() that is estimated, not compiled: 0 where the compile sizes it."""
        return self._estimated_workspace if self.for_gpus_elsewhere else 0

    @functools.cached_property
    def _estimated_workspace(self) -> int:  # read once from the compiled program's text (megabytes of it)
        return gpu_target.cudnn_workspace_bytes(self.compile_step().as_text())

    def memory_budget(self) -> float:
        """Bytes per device the step may use on this mesh's devices (hardware.memory_budget)."""
        return memory_budget(self.config.run.device_memory_gb, own_device(self.mesh))

    def check_fits(self) -> None:
        """Raise ConfigError (one line: what the step needs, the budget, the keys to change) when the compiled
        step needs more memory per device than run.device_memory_gb allows."""
        need, budget = self.memory_bytes(), self.memory_budget()
        if need > budget:
            t, remat_policy = self.config.train, self.config.remat.policy
            raise ConfigError(
                f"the train step ({t.microbatches} micro-batch(es), remat.policy={remat_policy}) needs "
                f"{format_bytes(need)} per device, over the budget of {format_bytes(budget)} (run.device_memory_gb); "
                "use train.microbatches=auto (or more), recompute more (remat.policy=full), shard over more devices "
                "(mesh.fsdp, mesh.tensor), or let `llama-jax tune` choose"
            )

    @contextlib.contextmanager
    def activate(self):
        """Context in which the steps may be traced and run: the mesh is jax's (jax.set_mesh: the model's logical
        constraints, which take their rules from self.context, are placed on it), and for a GPU that is not here
        jax's cuDNN checks answer for it (model/jax_workarounds.py)."""
        with (
            sharding.activate(self.mesh),
            jax_workarounds.cudnn_checks_answered_by(self.context.gpu),
        ):
            yield

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, e.g. as a target to restore a checkpoint into."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.state_shapes, self.state_shardings
        )

    def abstract_checkpoint(self) -> TrainState:
        """abstract_state() of what a checkpoint holds (a peft run: without the base), to restore one into."""
        return self.abstract_state().checkpointed()

    def abstract_params(self) -> Any:
        """Shapes, dtypes and shardings of the params the model runs with (a peft run: adapters and base)."""
        return self.abstract_state().model_params

    def with_frozen(self, state: TrainState, frozen: Any) -> TrainState:
        """A checkpointed() state made whole again: a peft run's base `frozen` put back beside the adapters."""
        if frozen is None:
            return state
        return PeftState(step=state.step, params=state.params, opt_state=state.opt_state, frozen=frozen)

    def start_state(self, restored: Any, frozen: Any = None) -> TrainState:
        """The state a run starts with, from where it starts (checkpoint/start.py's Restored): a restored
        checkpoint made whole (a peft run's base `frozen` beside its adapters), a new state around restored
        params (init_from), or a new state from config.seed (a peft run: new adapters on its base)."""
        if restored.state is not None:
            return self.with_frozen(restored.state, frozen)
        state = self.fresh_state(jax.random.key(self.config.seed), frozen)
        return state if restored.params is None else state.replace(params=restored.params)

    def fresh_state(self, rng: jax.Array, frozen: Any = None) -> TrainState:
        """A new state; a peft run takes its base `frozen` as loaded, initialising the adapters only
        (peft.start_adapters)."""
        if frozen is None:
            return self.init_state(rng)
        state = self.init_trained(rng)
        return self.with_frozen(
            state.replace(params=peft.start_adapters(state.params, frozen, self.config.seed)), frozen
        )

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes, dtypes and sharding of one global batch: with abstract_state(), what the train step is
        compiled for ahead of time (`llama-jax plan`)."""
        shape = (self.config.train.batch_size, self.config.train.seq_len)
        return {
            k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(self.mesh))
            for k, dtype in BATCH_FIELDS.items()
        }

    def local_rows(self) -> list[int]:
        """The rows of every global batch that this process loads."""
        return sharding.process_rows(self.mesh, self.config.train.batch_size, self.config.train.seq_len)

    def put(self, batch):
        return sharding.put_batch(batch, self.mesh, self.config.train.batch_size, self.config.mesh.load_balance)

    def evaluate(self, params, batches: Batches, n_batches: int) -> float:
        """Mean next-token loss of the model params `params` (a state's model_params) over the first
        n_batches of `batches` (inside activate())."""
        total, count, rows = 0.0, 0.0, self.local_rows()
        for i in range(n_batches):
            loss_sum, n = self.eval_step(params, self.put(batches.batch(i, rows)))
            total, count = total + float(loss_sum), count + float(n)
        return total / max(count, 1.0)


def unbox(tree):
    """A tree with nnx.Params (carrying logical axis names) -> the same tree with their values."""
    return jax.tree.map(lambda x: x.get_value() if is_param(x) else x, tree, is_leaf=is_param)


def lower_step(config: Config, platform_name: str, target: str = "h100", devices=None):
    """The train step of `config` on `devices` (default: all of this process's) lowered for `platform_name`
    ('cuda', 'rocm', 'tpu' or 'cpu') on this machine, with the kernels that platform runs and compiled by
    nothing: `.as_text()` is its StableHLO module (bench/lower.py; tests/test_cuda_lowering.py). For CUDA, jax's
    cuDNN checks answer as a `target` GPU would (gpu_target.py). train.microbatches=auto, which compiles steps to
    choose, becomes the fewest micro-batches a pipeline allows (1 without one)."""
    if config.train.microbatches == "auto":
        stages = sharding.mesh_shape(config.mesh, len(devices or jax.devices()))["pipeline"]
        fewest = fewest_microbatches(config.mesh, stages)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=fewest))
    mesh = sharding.make_mesh(config, devices=devices)
    gpu = gpu_target.traced_gpu(gpu_target.spec(target).name) if platform_name == "cuda" else None
    traced_for = "gpu" if platform_name in ("cuda", "rocm") else platform_name
    program = TrainProgram.build(config, mesh, TraceContext.on_mesh(mesh, sharding.axis_rules(config), traced_for, gpu))
    with program.activate():
        traced = program.train_step.trace(program.abstract_state(), program.abstract_batch())
        return traced.lower(lowering_platforms=(platform_name,))


def trace_context(config: Config, mesh: Mesh) -> TraceContext:
    """What the model of `config` on `mesh` is traced for: the platform of the mesh's devices, the mesh, the
    logical-axis table, and for compile-only GPUs (`--target`) what jax's cuDNN checks are told."""
    gpu = gpu_target.traced_gpu(mesh_device(mesh).device_kind) if gpus_elsewhere(mesh) else None
    return TraceContext.on_mesh(mesh, sharding.axis_rules(config), gpu=gpu)


def gpus_elsewhere(mesh: Mesh) -> bool:
    """Whether `mesh` is made of compile-only GPUs (`--target`): planned, never run here."""
    device = mesh_device(mesh)
    return device.platform == "gpu" and compile_only(device)


def pipeline_layout(config: Config, mesh: Mesh) -> PipelineLayout | None:
    """The pipeline's stages, repeats, micro-batches per pass, schedule and layers per group on `mesh`; None
    without pipelining."""
    stages = mesh.shape["pipeline"]
    if stages == 1:
        return None
    return PipelineLayout(
        stages,
        config.mesh.pipeline_repeats,
        pass_microbatches(config.mesh, config.train.microbatches),
        config.mesh.pipeline_schedule,
        layer_order(config, mesh).group_layers,
    )


def layer_order(config: Config, mesh: Mesh) -> LayerOrder:
    """The order of the layers in this run's state (model/stages.py)."""
    return LayerOrder.of(config.mesh, mesh.shape["pipeline"])


def step_memory_bytes(compiled) -> int:
    """Per device: arguments + temporaries + outputs that do not reuse (alias) donated arguments."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def own_device(mesh: Mesh):
    """This process's first device of the mesh (another process's cannot be asked for its memory), or the first
    of a mesh of compile-only devices (`--target`), which no process owns."""
    return next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), mesh_device(mesh))


def model_flops_per_token(config: Config, platform_name: str | None = None) -> float:
    """train_flops_per_token for the attention kernel this config runs on `platform_name` (default: this process's
    backend). Under context parallelism only
    cuDNN's padded calls skip the masked keys; the XLA kernel in their place computes them all. A peft
    run's frozen weights take part in the forward pass and the input gradients (4 FLOPs per parameter)
    but have no weight gradient (the other 2 of the 6); the adapters' own FLOPs are left out."""
    m = config.model
    kernel = select_implementation(
        m.attention, platform_name or jax.default_backend(), m.compute_dtype, m.resolved_head_dim, config.train.seq_len
    )
    skips = skips_masked_blocks(kernel) and (config.mesh.sequence == 1 or kernel == "cudnn")
    frozen = 2 * matmul_param_count(m) if config.peft.method != "none" else 0
    return train_flops_per_token(m, config.train.seq_len, skips) - frozen
