"""The compiled programs of one config on one mesh: the TrainProgram.

A TrainProgram is what training, evaluation, `plan`, `tune` and the benchmarks all build (with
`TrainProgram.for_config(config)`, or `build(config, mesh)` on a mesh they already have): the model's graph, the
state's shardings, and the jitted functions (init, train step, eval step) whose inputs and outputs are placed by
the logical-axis table of sharding.py. It chooses what the model is traced for, its TraceContext
(model/context.py): the mesh's platform, the mesh and that table (trace_context). What else concerns a program
is a module of its own: its memory and the micro-batch choice (memory.py), its batches and evaluation over them
(batches.py).
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
from flax import nnx
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh

from llama_jax.config import Config
from llama_jax.distributed import sharding
from llama_jax.model import jax_workarounds, peft
from llama_jax.model.attention import select_implementation
from llama_jax.model.context import TraceContext, mesh_device, mesh_platform
from llama_jax.model.llama import Llama
from llama_jax.model.params import abstract, is_param
from llama_jax.model.pipeline import PipelineLayout, fewest_microbatches, pass_microbatches
from llama_jax.model.stages import LayerOrder, to_storage_order
from llama_jax.perf import gpu_target
from llama_jax.perf.hardware import compile_only
from llama_jax.training import memory
from llama_jax.training.batches import abstract_batch
from llama_jax.training.optimizer import learning_rate, make_optimizer, muon_placements
from llama_jax.training.step import PeftState, TrainState, loss_terms, make_train_step


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


@dataclass(frozen=True)
class CompiledStep:
    """The train step compiled ahead of time, and what its compile did not size."""

    executable: Any  # jax's Compiled: memory_analysis(), as_text(), callable on the state and a batch
    workspace_bytes: int  # cuDNN attention's workspace on compile-only GPUs (gpu_target.cudnn_workspace_bytes), else 0


@dataclass
class TrainProgram:
    config: Config
    mesh: Mesh
    model: Llama  # abstract (params.abstract): the model's graph and shapes, traced for this program's context
    graph: nnx.GraphDef  # the model split once: what the jitted steps merge with the params they are given
    state_shardings: Any
    state_shapes: Any  # ShapeDtypeStructs of the state, traced once in build()
    init: Callable  # rng -> a new state, not jitted (init_state and init_checkpointed jit it)
    train_step: Callable
    eval_step: Callable  # (model params, batch) -> (summed loss, token count)
    compiled: CompiledStep | None = None  # the train step compiled ahead of time (compile_step); train_step reuses it

    @classmethod
    def for_config(cls, config: Config, devices=None) -> TrainProgram:
        """On config's mesh over `devices` (default: all). Raises ConfigError for a mesh that cannot work."""
        return cls.build(config, sharding.make_mesh(config, devices=devices))

    @classmethod
    def build(cls, config: Config, mesh: Mesh, context: TraceContext | None = None) -> TrainProgram:
        """The programs of `config` on `mesh`, traced for `context` (default: trace_context(config, mesh));
        train.microbatches=auto compiles the step for each count in turn and keeps the first that fits the
        memory budget (memory.py)."""
        context = context or trace_context(config, mesh)
        if config.train.microbatches == "auto":
            return memory.fewest_microbatches_that_fit(config, mesh, lambda c: cls.build(c, mesh, context))
        # Fail on an impossible attention kernel now, not in the middle of tracing the first step.
        m = config.model
        select_implementation(
            m.attention, mesh_platform(mesh), m.compute_dtype, m.resolved_head_dim, config.train.seq_len
        )
        layout = pipeline_layout(config, mesh)
        make_model = functools.partial(
            Llama,
            m,
            remat_config=config.remat,
            load_balanced=config.mesh.load_balance,
            peft=config.peft,
            pipeline=layout,
            context=context,
        )
        model = abstract(lambda: make_model(rngs=nnx.Rngs(0)))
        optimizer = make_optimizer(config.train, optimizer_placements(config, mesh))
        init, state_shardings, state_shapes = _state(
            make_init_state(make_model, optimizer, config, mesh), mesh, context
        )
        batch_sharding = sharding.batch_sharding(mesh)
        graph = nnx.graphdef(model)
        return cls(
            config=config,
            mesh=mesh,
            model=model,
            graph=graph,
            state_shardings=state_shardings,
            state_shapes=state_shapes,
            init=init,
            train_step=jax.jit(
                _train_step(config, graph, optimizer, layout),
                in_shardings=(state_shardings, batch_sharding),
                out_shardings=(state_shardings, sharding.replicated(mesh)),
                donate_argnums=(0,),
            ),
            eval_step=jax.jit(
                lambda params, batch: loss_terms(params, graph, batch),
                in_shardings=(state_shardings.model_params, batch_sharding),
            ),
        )

    def compile_step(self):
        """The train step compiled for the abstract state and batch (once; later calls of train_step reuse it).
        For GPUs that are not here (gpu_target.py) XLA:GPU compiles it under launch/gpu_env.sh's flags, and the
        cuDNN workspace its compile does not size is read from its text then (memory.py)."""
        if self.compiled is None:
            options = gpu_target.compiler_options() if self.for_gpus_elsewhere else None
            with self.activate():
                lowered = self.train_step.lower(self.abstract_state(), abstract_batch(self))
                executable = lowered.compile(compiler_options=options) if options else lowered.compile()
            workspace = gpu_target.cudnn_workspace_bytes(executable.as_text()) if self.for_gpus_elsewhere else 0
            self.compiled = CompiledStep(executable, workspace)
        return self.compiled.executable

    @property
    def for_gpus_elsewhere(self) -> bool:
        """Whether the mesh is made of compile-only GPUs (`--target`): planned, never run here."""
        return gpus_elsewhere(self.mesh)

    @property
    def context(self) -> TraceContext:
        """What the model is traced for (model/context.py)."""
        return self.model.context

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

    def init_state(self, rng: jax.Array) -> TrainState:
        """A new state, made directly in its shards (never materialised whole on one device); a peft run's base
        too: random, for benchmarks and tests."""
        return jax.jit(self.init, out_shardings=self.state_shardings)(rng)

    def init_checkpointed(self, rng: jax.Array) -> TrainState:
        """A new state's checkpointed() part: a peft run's adapters and their moments (its base is never made)."""
        return jax.jit(lambda rng: self.init(rng).checkpointed(), out_shardings=self.state_shardings.checkpointed())(
            rng
        )

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
        state = self.init_checkpointed(rng)
        return self.with_frozen(
            state.replace(params=peft.start_adapters(state.params, frozen, self.config.seed)), frozen
        )


def optimizer_placements(config: Config, mesh: Mesh) -> dict | None:
    """Where Muon's Newton-Schulz iterations run on a mesh of several devices (optimizer.muon_placements)."""
    if config.train.optimizer != "muon" or mesh.size == 1:
        return None
    stacked = layer_order(config, mesh).length(config.model.n_layers)  # uneven pipeline stages pad the stack
    return muon_placements(sharding.param_shardings(config, mesh), mesh, stacked)


def _state(init_state: Callable, mesh: Mesh, context: TraceContext) -> tuple[Callable, Any, Any]:
    """(rng -> a new state, not jitted; the state's shardings; its shapes). The shapes and logical axis names of
    the whole state are traced without allocating it; the optimizer moments inherit their parameter's names
    (nnx.Params, through optax), so they are sharded alike. Traced once: the initialiser replays this trace's
    jaxpr instead of building the model again."""
    init_jaxpr, boxed_shapes = jax.make_jaxpr(init_state, return_shape=True)(jax.random.key(0))
    replay_init, boxes = jaxpr_as_fun(init_jaxpr), jax.tree.structure(boxed_shapes)
    shardings = sharding.logical_to_sharding(boxed_shapes, mesh, context.rules)
    return lambda rng: unbox(jax.tree.unflatten(boxes, replay_init(rng))), shardings, unbox(boxed_shapes)


def _train_step(config: Config, graph: nnx.GraphDef, optimizer, layout: PipelineLayout | None) -> Callable:
    """The train step's function for `config`: with pipelining the micro-batches are the pipeline's (inside the
    model) and the step accumulates the gradient over the passes through it, if there are several; a peft run with
    dropout draws step n's masks from (seed, n)."""
    t, adapting = config.train, config.peft.method != "none"
    accumulate = t.microbatches // layout.microbatches if layout else t.microbatches
    dropout_seed = config.seed if adapting and config.peft.dropout > 0 else None
    return make_train_step(graph, optimizer, learning_rate(t), accumulate, dropout_seed)


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
        traced = program.train_step.trace(program.abstract_state(), abstract_batch(program))
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
