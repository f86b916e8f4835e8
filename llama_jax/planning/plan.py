"""`llama-jax plan`: compile the train step ahead of time and report what one step will cost.

Nothing runs and nothing is allocated: the state and batch are abstract (shapes, dtypes and
shardings), so a 405B model can be planned on a laptop with simulated devices. Reported per device:
memory (arguments, temporaries, total), HLO FLOPs with every scanned layer counted (and the share of fp8
matmuls, model.fp8), model FLOPs,
bytes moved by each collective kind next to the analytic minimum for the mesh, and the same bytes by
the mesh axes each collective spans and the link tier it crosses (within a host, or between hosts:
costmodel.py; `--devices-per-host` plans a cluster's hosts on simulated devices). With pipeline
parallelism a device is one stage, and the plan adds the bubble: the schedule's (P-1)/(M·R+P-1) next to
what the compiled loop does, the point-to-point (collective permute) bytes, and per stage its layers, the
micro-batches it keeps in flight and its memory. On a device with a data sheet (a GPU, --target too) the
plan adds the step time that `llama-jax tune`'s cost model predicts (fp8 matmuls at the fp8 peak) and the
MFU it would give, against the compute dtype's peak and, under model.fp8, the fp8 peak (hardware.MfuPeaks).
The report, as text or JSON: plan_report.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llama_jax.config import Config
from llama_jax.config.choices import REMAT_POLICIES
from llama_jax.config.stages import Stage
from llama_jax.files import cache_root
from llama_jax.model import remat
from llama_jax.model.context import mesh_device, mesh_platform
from llama_jax.model.context_parallel import CHUNK_CHOICE_SCOPE, PREFIX_SCOPE
from llama_jax.model.cudnn import KERNEL_CHOICE_SCOPE
from llama_jax.model.llama import param_count
from llama_jax.model.pipeline import bubble_fraction, pass_microbatches
from llama_jax.model.stack import one_f_one_b_schedule
from llama_jax.model.stack.grouped import LAYER_SLOT_SCOPE
from llama_jax.perf import costmodel, gpu_target, hardware, hlo, xla_log
from llama_jax.perf.costmodel import AxisTraffic
from llama_jax.training.memory import cudnn_workspace_bytes, memory_budget, memory_bytes, step_memory_bytes
from llama_jax.training.program import TrainProgram
from llama_jax.training.step import OPTIMIZER_SCOPE, model_flops_per_token


@dataclass(frozen=True)
class Plan:
    mesh: dict[str, int]
    devices: int
    argument_bytes: int  # per device: state + batch
    temporary_bytes: int  # per device: activations and other scratch
    output_bytes: int  # per device, not counting outputs that reuse (alias) donated arguments
    total_bytes: int  # per device peak estimate: arguments + temporaries + unaliased outputs (+ workspace)
    host_temporary_bytes: int  # per device, in pinned host memory (activations offloaded by remat)
    hlo_flops: float  # per step, all devices, from the compiled program (layers counted)
    model_flops: float  # per step: train_flops_per_token x tokens
    collective_bytes: dict[str, float]  # per device per step, by kind (ring cost model)
    collective_minimum: dict[str, float]  # analytic minimum per device per step, by parallelism
    compile_seconds: float
    microbatches: int = 1  # train.microbatches (auto resolved)
    budget_bytes: float = 0.0  # per device: run.device_memory_gb or the default budget
    memory_traffic_bytes: float = 0.0  # per device per step: bytes every operation reads and writes
    # Per operation (FLOPs, bytes) per device per step, for roofline estimates (hlo.HloStats); not printed.
    operations: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    hosts: int = 1  # hosts the devices sit on (the processes, or devices / --devices-per-host)
    # collective_bytes by the mesh axes each collective spans and the tier it crosses (costmodel.py)
    collective_by_axis: tuple[AxisTraffic, ...] = ()
    pipeline_repeats: int = 1  # mesh.pipeline_repeats (the stages are mesh["pipeline"])
    bubble: float = 0.0  # the schedule's idle share of the step: (P-1)/(M·R+P-1)
    # The same from the compiled program: 1 - M·R / the iterations of its pipeline loop (None: no pipeline)
    compiled_bubble: float | None = None
    pipeline_iterations: int | None = None  # of the compiled pipeline loop
    pass_microbatches: int = 0  # micro-batches per pass through the pipeline (mesh.pipeline_microbatches or all)
    schedule: str = ""  # mesh.pipeline_schedule (with a pipeline)
    stage_layers: tuple[int, ...] = ()  # per stage, the layers it runs (all repeats)
    in_flight: tuple[int, ...] = ()  # per stage, the most micro-batches (of one group of layers) it keeps at once
    stage_bytes: tuple[int, ...] = ()  # per stage, the memory it uses per device (pipeline_stages())
    # GPUs compiled for without them (--target): their kind, and cuDNN's attention workspace, which their compile
    # does not size: estimated (gpu_target.cudnn_workspace_bytes) and counted in total_bytes
    target: str = ""
    cudnn_workspace_bytes: int = 0
    fp8: str = "none"  # model.fp8
    fp8_flops: float = 0.0  # per step, all devices: the HLO FLOPs of matmuls with fp8 operands (part of hlo_flops)
    # On a device with a data sheet: the cost model's step time (costmodel.data_sheet_cost_model) and the MFU it
    # gives against the compute dtype's peak and the fp8 peak (hardware.MfuPeaks; None where there is none).
    predicted_step_s: float | None = None
    predicted_mfu: float | None = None
    predicted_mfu_fp8: float | None = None
    peaks: str = ""  # the peaks' figures and sources, or why there is no fp8 one
    rematerialized: tuple[str, ...] = ()  # what XLA's partitioner replicated whole to reshard (xla_log.py)
    optimizer: str = "adamw"  # train.optimizer
    # Of collective_total: the bytes of the collectives in the optimizer's update (Muon's resharding, for one)
    optimizer_collective_bytes: float = 0.0

    @property
    def collective_total(self) -> float:
        return sum(self.collective_bytes.values())

    @property
    def minimum_total(self) -> float:
        return sum(self.collective_minimum.values())

    @property
    def collective_tiers(self) -> dict[str, float]:
        return costmodel.tier_totals(self.collective_by_axis)


def collective_minimum(config: Config, sizes: dict[str, int]) -> dict[str, float]:
    """The least each device must send per step for this mesh, in the ring cost model of hlo.py.

    fsdp     weights all-gathered for the forward and again for the backward, gradients
             reduce-scattered: 3 (f-1)/f x the weight bytes a tensor shard holds.
    data     gradients all-reduced over the devices holding the same weights but other tokens
             (data and sequence): 2 (g-1)/g x one device's gradient bytes.
    tensor   per layer two all-reduces in the forward and two in the backward of the
             [batch, seq, embed] activations (sequence parallelism turns each into an all-gather
             plus a reduce-scatter of the same total), plus one each for embedding and logits.
    sequence per layer keys and values all-gathered (forward) and their gradients
             reduce-scattered (backward): 2 (s-1)/s x the full-sequence K and V bytes.
    """
    m, t = config.model, config.train
    f, d, tp, s, p = sizes["fsdp"], sizes["data"], sizes["tensor"], sizes["sequence"], sizes.get("pipeline", 1)
    # A stage holds 1/p of the layers and the embedding and output projection whole.
    embedding_params = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    param_bytes = ((param_count(m) - embedding_params) / p + embedding_params) * jnp.dtype(m.param_dtype).itemsize
    compute_bytes = jnp.dtype(m.compute_dtype).itemsize
    local_batch = t.batch_size / (d * f)
    activation = local_batch * t.seq_len / s * m.d_model * compute_bytes
    repeats = config.mesh.pipeline_repeats if p > 1 else 1
    kv_shards = tp if m.n_kv_heads % tp == 0 else 1  # fewer kv heads than tensor shards: replicated
    kv_full = local_batch * t.seq_len * 2 * m.n_kv_heads / kv_shards * m.resolved_head_dim * compute_bytes
    replicas = d * s  # devices that share weights but see different tokens
    return {
        "fsdp": 3 * (f - 1) / f * param_bytes / tp,
        "data": 2 * (replicas - 1) / replicas * param_bytes / (tp * f),
        "tensor": (4 * m.n_layers / p + 2) * 2 * (tp - 1) / tp * activation,
        "sequence": 2 * (s - 1) / s * kv_full * m.n_layers / p,
        # every micro-batch's activations handed on once per repeat, forward and backward
        "pipeline": 2 * repeats * activation / tp if p > 1 else 0.0,
    }


def _along(topology: costmodel.Topology, axis: str):
    """Whether every (source, target) pair of a collective permute differs along `axis` only."""
    index = topology.axis_names.index(axis)

    def wanted(pairs) -> bool:
        moves = [[topology.coordinates(d) for d in pair] for pair in pairs]
        return (
            bool(moves)
            and all(a[i] == b[i] for a, b in moves for i in range(len(a)) if i != index)
            and any(a[index] != b[index] for a, b in moves)
        )

    return wanted


def make_plan(config: Config, mesh: Mesh, devices_per_host: int = 0) -> Plan:
    """devices_per_host = 0: the hosts are the processes of this run; else hosts of that many devices."""
    topology = costmodel.mesh_topology(mesh, devices_per_host)  # a bad host size fails before compiling
    start, log = time.perf_counter(), []
    with xla_log.captured(log):
        program = TrainProgram.build(config, mesh)  # train.microbatches=auto compiles the counts it tries
        compiled = program.compile_step()
    compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    devices = mesh.devices.size
    text = compiled.as_text()
    shares = work_shares(config, dict(mesh.shape))
    stats = hlo.analyze(text, devices, branch_runs(program), shares, scopes=(OPTIMIZER_SCOPE,))
    # The roofline's operations at the pace of the busiest stage: a pipeline's stages wait for each other.
    operations = (
        hlo.analyze(text, devices, branch_runs(program, busiest=True), shares).operations
        if program.model.pipeline
        else stats.operations
    )
    stages, repeats = mesh.shape.get("pipeline", 1), config.mesh.pipeline_repeats
    microbatches = pass_microbatches(config.mesh, program.config.train.microbatches)  # of one pass
    iterations = pipeline_iterations(text, devices, topology) if stages > 1 else None
    staged = pipeline_stages(program, text, step_memory_bytes(compiled)) if stages > 1 else {}
    traffic = costmodel.traffic_by_axis(stats.collective_groups, topology)
    model_flops = model_flops_per_token(config, mesh_platform(mesh)) * config.train.batch_size * config.train.seq_len
    return Plan(
        mesh=dict(mesh.shape),
        devices=devices,
        argument_bytes=memory.argument_size_in_bytes,
        temporary_bytes=memory.temp_size_in_bytes,
        output_bytes=memory.output_size_in_bytes - memory.alias_size_in_bytes,
        total_bytes=memory_bytes(program),
        host_temporary_bytes=memory.host_temp_size_in_bytes,
        hlo_flops=stats.dot_flops * devices,
        model_flops=model_flops,
        collective_bytes={kind: c.moved_bytes for kind, c in stats.collectives.items()},
        collective_minimum=collective_minimum(config, dict(mesh.shape)),
        compile_seconds=compile_seconds,
        microbatches=program.config.train.microbatches,
        budget_bytes=memory_budget(program),
        memory_traffic_bytes=stats.memory_bytes,
        operations=operations,
        hosts=topology.host_count,
        collective_by_axis=traffic,
        pipeline_repeats=repeats,
        bubble=bubble_fraction(stages, microbatches, repeats) if stages > 1 else 0.0,
        compiled_bubble=compiled_bubble(config.mesh.pipeline_schedule, stages, repeats, microbatches, iterations),
        pipeline_iterations=iterations,
        pass_microbatches=microbatches if stages > 1 else 0,
        **staged,
        target=gpu_target.describe(mesh_device(mesh)) if program.for_gpus_elsewhere else "",
        cudnn_workspace_bytes=cudnn_workspace_bytes(program),
        fp8=config.model.fp8,
        fp8_flops=stats.fp8_flops * devices,
        optimizer=config.train.optimizer,
        optimizer_collective_bytes=stats.scope_collective_bytes[OPTIMIZER_SCOPE],
        **predicted_speed(config, mesh, operations, costmodel.tier_totals(traffic), model_flops),
        rematerialized=xla_log.rematerializations("".join(log)),
    )


def pipeline_iterations(hlo_text: str, devices: int, topology: costmodel.Topology) -> int | None:
    """The iterations of the compiled pipeline loop: the most of any loop handing data on along the pipeline."""
    return max(hlo.permute_loop_trips(hlo_text, devices, _along(topology, "pipeline")), default=None)


def predicted_speed(config: Config, mesh: Mesh, operations, tier_bytes: dict[str, float], model_flops: float) -> dict:
    """Plan's fields for the predicted step time and its MFU on a device with a data sheet; {} elsewhere (a CPU:
    its peak is measured, which a plan does not do; `llama-jax tune` does)."""
    device = mesh_device(mesh)
    model = costmodel.data_sheet_cost_model(config.model.compute_dtype, device.device_kind)
    if model is None:
        return {}
    step_s = model.predict(operations, tier_bytes)
    peaks = hardware.mfu_peaks(config.model.compute_dtype, config.model.fp8, cache_root(config.data.cache_dir), device)
    mfu = peaks.fractions(model_flops / step_s, mesh.devices.size)
    return {
        "predicted_step_s": step_s,
        "predicted_mfu": mfu["mfu"],
        "predicted_mfu_fp8": mfu["mfu_fp8"],
        "peaks": peaks.describe(),
    }


def branch_runs(program: TrainProgram, busiest: bool = False) -> hlo.BranchRuns:
    """How often the step's conditionals run each branch (hlo.analyze). cuDNN attention's choice of kernel by the
    documents in a row: its first branch, one document per row, the rest never (cudnn.py). Context parallelism's
    choice per chunk: its second, the prefix of a document begun in an earlier chunk (context_parallel.py). The
    pipeline's: under 1F1B the forward, loss and backward passes (one_f_one_b_schedule.branch_runs), with uneven
    stages the layers' slots; on average over the stages, or with `busiest` on the busiest stage (which runs every
    slot)."""
    runs: hlo.BranchRuns = {KERNEL_CHOICE_SCOPE: (1.0,), CHUNK_CHOICE_SCOPE: (0.0, 1.0)}
    layout, n_layers = program.model.pipeline, program.config.model.n_layers
    if layout is None:
        return runs
    runs[LAYER_SLOT_SCOPE] = 1.0 if busiest else n_layers / layout.order.length(n_layers)
    if layout.schedule == "1f1b":
        tables = one_f_one_b_schedule.schedule(layout.stages, layout.repeats, layout.microbatches)
        runs.update(one_f_one_b_schedule.branch_runs(tables, busiest))
    return runs


def work_shares(config: Config, sizes: dict[str, int]) -> hlo.WorkShares:
    """The share of its compiled shape's work each padded kernel does (hlo.analyze). Context parallelism's prefix
    kernel reads the whole gathered sequence, of which one document per row uses the chunk's earlier keys. The
    step waits on the busiest device: with load balancing every device's two chunks reach back 2s-1 chunks of
    the 2s over their two calls (s = mesh.sequence), so (2s-1)/(4s) of the calls' keys; without it, the last
    device's one chunk reaches back s-1 of the s."""
    shards = sizes.get("sequence", 1)
    if shards == 1:
        return {}
    return {PREFIX_SCOPE: (2 * shards - 1) / (4 * shards) if config.mesh.load_balance else (shards - 1) / shards}


def compiled_bubble(
    schedule: str, stages: int, repeats: int, microbatches: int, iterations: int | None
) -> float | None:
    """The bubble the compiled pipeline loop of `iterations` runs (None: no such loop). GPipe: every stage
    computes in each iteration, M·R of them its own; 1F1B: one_f_one_b_schedule.compiled_bubble."""
    if not iterations:
        return None
    if schedule == "1f1b":
        return one_f_one_b_schedule.compiled_bubble(stages, repeats, microbatches, iterations)
    return 1 - microbatches * repeats / iterations


def pipeline_stages(program: TrainProgram, hlo_text: str, total: int) -> dict:
    """Per stage: its layers, the micro-batches it keeps in flight, and its memory per device. Every stage
    runs the same program, whose buffers are sized for the busiest stage (the compiled total): a stage
    with fewer layers leaves slots of the layer stack empty (their weights, moments and gradients), and
    under 1F1B a stage with fewer micro-batches in flight leaves residual slots unused; those are not
    counted in its figure."""
    config = program.config
    layout = program.model.pipeline
    order = layout.order
    stages = order.stage_layers(config.model.n_layers)  # [P, R]
    slots = order.slots(config.model.n_layers) * order.repeats
    # Bytes per device of one slot of the layer stack: params and both moments stored, the gradient computed.
    state = sum(
        _device_bytes(a)
        for path, a in jax.tree_util.tree_flatten_with_path(program.abstract_state())[0]
        if any(getattr(k, "key", None) == "layers" for k in path)
    )
    grads = sum(
        _device_bytes(a)
        for path, a in jax.tree_util.tree_flatten_with_path(program.abstract_params())[0]
        if any(getattr(k, "key", None) == "layers" for k in path)
    )
    per_layer = (state + grads) / slots
    if layout.schedule == "1f1b":
        schedule = one_f_one_b_schedule.schedule(layout.stages, layout.repeats, layout.microbatches)
        in_flight, kept = schedule.in_flight, sum(hlo.named_buffer_bytes(hlo_text, one_f_one_b_schedule.SLOTS_SCOPE))
        per_slot = kept / schedule.slots
    else:  # GPipe keeps every micro-batch of a pass
        in_flight, per_slot = (layout.microbatches,) * layout.stages, 0.0
    free = [
        (slots - int(stages[p].sum())) * per_layer + (max(in_flight) - in_flight[p]) * per_slot
        for p in range(layout.stages)
    ]
    return {
        "schedule": layout.schedule,
        "stage_layers": tuple(int(n) for n in stages.sum(axis=1)),
        "in_flight": tuple(in_flight),
        "stage_bytes": tuple(int(total - f) for f in free),
    }


def _device_bytes(a) -> int:
    shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
    return int(np.prod(shape)) * a.dtype.itemsize


def compare_remat(config: Config, mesh: Mesh, print_fn=None, devices_per_host: int = 0) -> dict[str, Plan]:
    """A plan for every named remat policy (same config and mesh otherwise). A policy that runs like one
    already planned on these devices (an offload policy where there is no pinned host memory) shares its plan."""
    plans: dict[str, Plan] = {}
    planned: dict[tuple | None, str] = {}  # remat.placement -> the first policy planned with it
    for policy in REMAT_POLICIES:
        variant = dataclasses.replace(config, remat=dataclasses.replace(config.remat, policy=policy))
        twin = planned.setdefault(remat.placement(variant.remat), policy)
        plans[policy] = plans[twin] if twin != policy else make_plan(variant, mesh, devices_per_host)
        if print_fn:
            print_fn(
                f"remat.policy={policy} runs like {twin} on these devices: same plan"
                if twin != policy
                else f"compiled remat.policy={policy} in {plans[policy].compile_seconds:.1f}s"
            )
    return plans


def stage_plans(stages: list[Stage], mesh_of: Callable[[Config], Mesh], devices_per_host: int = 0) -> list[Plan]:
    """A staged run's plan, a stage at a time, each on its own mesh (`mesh_of` its config: mesh.sequence may grow)."""
    return [make_plan(s.config, mesh_of(s.config), devices_per_host) for s in stages]
