"""The trace context (model/context.py): the model picks its kernels, shard_maps and shardings from the TraceContext
it is given, never from ambient state; and the one jax workaround (model/jax_workarounds.py) still applies to the
installed jax."""

import dataclasses
import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY_MODEL, forward
from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn

from llama_jax.model import jax_workarounds
from llama_jax.model.context import Gpu, TraceContext, logical_to_mesh_axes
from llama_jax.model.llama import Llama, abstract_model, param_shapes

MODEL_DIR = Path(__file__).resolve().parents[1] / "llama_jax" / "model"
H100 = Gpu("9.0", 91000)


def grad_jaxpr(model: Llama, seq: int = 32) -> str:
    """The jaxpr of the gradient of the model's loss on one batch, as text (traced, nothing compiled)."""
    params = param_shapes(model.cfg)
    tokens = jnp.zeros((2, seq), jnp.int32)

    def loss(params):
        return forward(model, params, tokens, targets=tokens)[0]

    with jax_workarounds.cudnn_checks_answered_by(model.context.gpu):
        return str(jax.make_jaxpr(jax.grad(loss))(params))


def test_the_model_picks_the_kernels_of_its_contexts_platform_not_this_processs():
    """On this CPU process, a model traced for GPUs (with no mesh, rules or anything else active) runs cuDNN
    attention and einsum's backward for its projections; the same model for this process runs the blocked kernel
    and the CPU backward pass (an optimization barrier keeps its moved operand)."""
    assert jax.default_backend() == "cpu"
    cfg = dataclasses.replace(TINY_MODEL, compute_dtype="bfloat16", d_model=128, n_heads=4, n_kv_heads=2)
    here, for_gpus = (
        grad_jaxpr(abstract_model(cfg)),
        grad_jaxpr(abstract_model(cfg, context=TraceContext("gpu", gpu=H100))),
    )
    assert abstract_model(cfg).context == TraceContext.local() == TraceContext("cpu")
    assert "optimization_barrier" in here and "optimization_barrier" not in for_gpus
    assert "dot_product_attention_fwd" in for_gpus and "dot_product_attention_fwd" not in here


def test_a_pipeline_stages_context_drops_the_stage_axis_and_makes_it_manual():
    mesh = jax.make_mesh((2, 4), ("pipeline", "fsdp"), devices=jax.devices()[:8])
    rules = (("batch", ("fsdp", "pipeline")), ("layers", "pipeline"), ("embed", "fsdp"))
    context = TraceContext.on_mesh(mesh, rules)
    assert (context.platform, context.axis_size(("fsdp", "pipeline")), context.axis_size("sequence")) == ("cpu", 8, 1)
    stage = context.inside_stage()
    assert stage.rules == (("batch", ("fsdp",)), ("layers", None), ("embed", "fsdp"))
    assert stage.manual_axes == ("pipeline",) and context.manual_axes == ()
    assert hash(stage) != hash(context)  # frozen and hashable: a field of Flax modules


def test_under_context_parallelism_a_weight_is_read_gathered_over_the_batch_and_sequence_axes():
    """Where the mesh splits the sequence, a matmul reads its weight split over `tensor` only, whether the rules
    store it over fsdp (the default) or over fsdp and sequence (llama3_405b's long-context stages); without
    context parallelism `read` adds nothing to the program, nor for parameters stored over neither."""
    auto = (jax.sharding.AxisType.Auto,) * 3  # as sharding.make_mesh's: the partitioner places what is not pinned
    context_parallel, fsdp = (
        jax.make_mesh(shape, ("fsdp", "sequence", "tensor"), axis_types=auto, devices=jax.devices()[:8])
        for shape in ((2, 2, 2), (4, 1, 2))
    )
    default = (("batch", "fsdp"), ("seq", "sequence"), ("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    long_context = (*default[:2], ("embed", ("fsdp", "sequence")), *default[3:])
    read = jax.jit(lambda w, context: context.read(w, ("embed", "mlp")), static_argnums=1)
    for rules in (default, long_context):
        stored = jax.sharding.NamedSharding(context_parallel, logical_to_mesh_axes(("embed", "mlp"), rules))
        w = jax.device_put(jnp.ones((8, 16)), stored)
        with jax.set_mesh(context_parallel):  # as the train step is traced (sharding.activate)
            assert read(w, TraceContext.on_mesh(context_parallel, rules)).sharding.spec == jax.P(None, "tensor")
        assert TraceContext.on_mesh(context_parallel, rules).read(w, ("norm",)) is w
    assert TraceContext.on_mesh(fsdp, default).read(w, ("embed", "mlp")) is w
    assert TraceContext.local().read(w, ("embed", "mlp")) is w


def test_nothing_under_model_reads_ambient_trace_state():
    """The platform, the mesh and the rules come from the context: no contextvar, no abstract mesh, no ambient
    logical-axis rules read under model/, and jax's private module patched in one place only."""
    sources = {p.relative_to(MODEL_DIR).as_posix(): p.read_text() for p in MODEL_DIR.rglob("*.py")}
    for name, text in sources.items():
        for read in (
            "contextvars",
            "get_abstract_mesh",
            "get_logical_axis_rules",
            "logical_axis_rules(",
            "default_backend()",
        ):
            assert read not in text or (name, read) == ("context.py", "default_backend()"), (name, read)
        assert "setattr(" not in text or name == "jax_workarounds.py", name


def test_jaxs_cudnn_checks_still_ask_this_process_so_the_workaround_still_applies():
    """Fails when the installed jax leaves the range the workaround was checked for, or when jax's cuDNN checks stop
    answering from this process's backend (on this CPU-only machine: no Hopper GPU): then see whether jax takes the
    target's answers and drop jax_workarounds.cudnn_checks_answered_by."""
    assert jax_workarounds.applies(jax.__version__), (
        f"jax {jax.__version__} is outside {jax_workarounds.CUDNN_CHECKS_APPLY_TO}: check whether jax's cuDNN checks "
        "still read the local backend, then update the range (or drop the workaround)"
    )
    assert not jax_workarounds.applies("0.9.2") and not jax_workarounds.applies("0.13.0")
    if jax.default_backend() != "cpu":
        pytest.skip("the limitation shows on a machine without a GPU")
    assert jax_cudnn.check_compute_capability("9.0") is False
    assert jax_cudnn.is_cuda_compute_capability_equal("9.0") is False
    saved = {name: getattr(jax_cudnn, name) for name in jax_workarounds.CUDNN_CHECKS}
    with jax_workarounds.cudnn_checks_answered_by(H100):
        assert jax_cudnn.check_compute_capability("9.0") and not jax_cudnn.check_compute_capability("10.0")
        assert jax_cudnn.is_cuda_compute_capability_equal("9.0") and jax_cudnn.check_cudnn_version() == 91000
    assert {name: getattr(jax_cudnn, name) for name in jax_workarounds.CUDNN_CHECKS} == saved
    with jax_workarounds.cudnn_checks_answered_by(None):  # a GPU that is here, or no GPU: jax's own answers
        assert {name: getattr(jax_cudnn, name) for name in jax_workarounds.CUDNN_CHECKS} == saved


def test_the_private_jax_apis_used_are_still_the_only_way_so_reaching_into_jax_is_still_needed():
    """jax_workarounds.py is the one module importing jax._src, for three things jax 0.10-0.12 offer no public API
    for. Fails when the installed jax leaves the range they were read in, or offers one of them publicly: then use
    it and drop the private import."""
    assert jax_workarounds.applies(jax.__version__, jax_workarounds.PRIVATE_APIS_CHECKED), jax.__version__
    public = inspect.signature(jax.nn.dot_product_attention).parameters
    assert not {"q_offsets", "kv_offsets", "q_seqlen", "segment_ids"} & set(public)  # cuDNN's packed layout
    assert not {"client", "global_state", "key_value_set"} & set(dir(jax.distributed))  # the coordination client
    assert not hasattr(jax, "enable_compilation_cache")  # a scope without the compilation cache
    private = re.compile(r"^\s*(from|import) jax\._src", re.MULTILINE)
    package = MODEL_DIR.parent
    importing = [p.relative_to(package).as_posix() for p in package.rglob("*.py") if private.search(p.read_text())]
    assert importing == ["model/jax_workarounds.py"]
