"""Compile for GPUs that are not here: XLA:GPU's own compile of a step for an H100, H200, A100 or B200 cluster,
on any machine (deviceless ahead-of-time compilation; `llama-jax plan|tune --target h100 --gpus N`).

The CUDA plugin of jax (the `gpu` extra: Python >= 3.12, jax >= 0.11.1) compiles without a GPU:
`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1 x H x D", target_config=...)` gives
compile-only devices of H hosts with D GPUs each, and a step lowered on a mesh of them compiles to XLA:GPU's
optimized program (cuBLAS(Lt) GEMMs, cuDNN attention, NCCL collectives) with its buffer assignment. The target
config (XLA's GpuTargetConfigProto, as text) is written here from hardware.GPU_SPECS, the data sheets' figures.
The step compiles under launch/gpu_env.sh's XLA flags (GPU_ENV_FLAGS, passed as the compile's options, so the
CPU compiles of the same process are not touched).

What such a compile cannot know, and what is done about it:
- no autotuning (turned off: nothing to time): cuBLASLt takes its first algorithm, which changes speed, not
  memory;
- cuDNN attention's workspace is not sized (u8[0]): cudnn_workspace_bytes() adds it from the sizes measured on
  an H100 (docs/performance.md), applied to the largest cuDNN attention call of the compiled step;
- jax checks the local GPU while tracing cuDNN attention: model/jax_workarounds.py answers for the target (the
  TraceContext's gpu, traced_gpu).
The plugin registers only where its CUPTI check passes, which on a machine without a driver needs
JAX_PLATFORMS=cpu before jax starts (the CLI sets it for --target; the compile needs no local GPU).
"""

from __future__ import annotations

import importlib.util
import math
import re

import jax
from jax.experimental import topologies

from llama_jax.errors import InputError
from llama_jax.model.context import Gpu
from llama_jax.perf.hardware import GPU_SPECS, GpuSpec, table_bandwidth, table_key

# --target names -> the hardware table (H100 and H200 SXM, A100 SXM 80GB, B200 as on an HGX board).
TARGETS = {"h100": "H100", "h200": "H200", "a100": "A100", "b200": "B200"}
GPUS_PER_HOST = 8  # an HGX/DGX node

# launch/gpu_env.sh's XLA flags, in its order (tests/test_gpu_target.py checks that they are the same).
GPU_ENV_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_pipeline_all_gather=on",
    "--xla_gpu_pipeline_reduce_scatter=on",
    "--xla_gpu_pipeline_all_reduce=on",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_command_buffer=",
    "--xla_disable_hlo_passes=rematerialization",
)

# Limits every datacenter GPU of the table shares (CUDA programming guide, compute capabilities 8.0-10.0).
_THREADS_PER_BLOCK, _THREADS_PER_SM, _WARP, _REGISTERS = 1024, 2048, 32, 65536
_GRID_LIMITS = (2**31 - 1, 65535, 65535)
_SHARED_PER_BLOCK_KIB = 48  # without opting in to more


def plugin_missing() -> str | None:
    """Why XLA:GPU cannot compile here (one line), or None: jax's CUDA plugin is not installed."""
    if importlib.util.find_spec("jax_plugins") and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12)
    ):
        return None
    return (
        f"--target compiles the step with XLA:GPU, which needs jax's CUDA plugin; this install has jax "
        f"{jax.__version__} without it: pip install -e '.[gpu]' (Python >= 3.12, jax >= 0.11.1)"
    )


def spec(target: str) -> GpuSpec:
    if target not in TARGETS:
        raise InputError(f"--target {target}: unknown GPU; use one of {', '.join(TARGETS)}")
    return GPU_SPECS[TARGETS[target]]


def traced_gpu(device_kind: str) -> Gpu:
    """What jax's cuDNN checks are told while tracing for a GPU of this kind that is not here (the TraceContext's
    gpu: model/jax_workarounds.py)."""
    s = GPU_SPECS[table_key(device_kind)]
    major, minor, patch = (int(part) for part in (s.cudnn.split(".") + ["0", "0"])[:3])
    return Gpu(s.compute_capability, major * 10000 + minor * 100 + patch)


def target_config(target: str) -> str:
    """XLA's GpuTargetConfigProto, as text, for one GPU of `target`, from hardware.GPU_SPECS."""
    s = spec(target)
    major, minor = s.compute_capability.split(".")
    cudnn, cuda = (s.cudnn.split(".") + ["0", "0"])[:3], (s.cuda.split(".") + ["0", "0"])[:3]
    info = {
        "threads_per_block_limit": _THREADS_PER_BLOCK,
        "threads_per_warp": _WARP,
        "shared_memory_per_block": _SHARED_PER_BLOCK_KIB * 1024,
        "shared_memory_per_core": s.shared_kib_per_sm * 1024,
        "threads_per_core_limit": _THREADS_PER_SM,
        "core_count": s.sms,
        "fpus_per_core": s.fp32_cores_per_sm,
        "block_dim_limit_x": _GRID_LIMITS[0],
        "block_dim_limit_y": _GRID_LIMITS[1],
        "block_dim_limit_z": _GRID_LIMITS[2],
        "memory_bandwidth": int(table_bandwidth(s.name)[0]),
        "l2_cache_size": int(s.l2_mib * 2**20),
        "clock_rate_ghz": s.boost_ghz,
        "device_memory_size": int(s.memory_gib * 2**30),
        "shared_memory_per_block_optin": s.shared_kib_per_block * 1024,
        "registers_per_core_limit": _REGISTERS,
        "registers_per_block_limit": _REGISTERS,
    }
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (
        f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}\n"
        f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: {cuda[2]} }}\n"
        f'device_description_str: "{s.name}"\n'
    )


def devices(target: str, gpus: int, gpus_per_host: int = 0) -> list:
    """Compile-only devices of `gpus` GPUs of `target` in hosts of gpus_per_host (default: 8, or all of them if
    fewer), in host order: what a mesh for the cluster is made of (sharding.make_mesh(config, devices))."""
    spec(target)
    per_host = gpus_per_host or min(gpus, GPUS_PER_HOST)
    if gpus < 1 or per_host < 1 or gpus % per_host:
        raise InputError(
            f"--gpus {gpus} --gpus-per-host {per_host}: the GPUs must fill whole hosts "
            "(--gpus a positive multiple of --gpus-per-host)"
        )
    if (reason := plugin_missing()) is not None:
        raise InputError(reason)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{gpus // per_host}x{per_host}", target_config=target_config(target)
        )
    except Exception as err:  # noqa: BLE001 - jax's many ways of saying the plugin did not register
        raise InputError(
            f"--target {target}: jax's CUDA plugin did not give a topology ({str(err).splitlines()[0]}); "
            "on a machine without an NVIDIA driver set JAX_PLATFORMS=cpu before jax starts"
        ) from None
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def _option(flag: str) -> tuple[str, bool | int | str]:
    """`--name=value` as gpu_env.sh writes it -> the compile option XLA takes (typed; enums by name)."""
    name, _, value = flag.removeprefix("--").partition("=")
    if value in ("true", "false"):
        return name, value == "true"
    if value.isdigit():
        return name, int(value)
    if name.startswith("xla_gpu_pipeline_"):  # the flag parser's on/off are the enum's short names
        return name, f"COLLECTIVE_PIPELINING_MODE_{value.upper()}"
    return name, value


def compiler_options() -> dict[str, bool | int | str]:
    """GPU_ENV_FLAGS as options of one compile, without autotuning: there is no GPU to time kernels on, and
    XLA's autotuner takes half the compile to find that out (the program and its buffers are the same)."""
    return {**dict(map(_option, GPU_ENV_FLAGS)), "xla_gpu_autotune_level": 0}


# cuDNN's workspace for flash attention's forward and backward pass, measured on an H100 (docs/performance.md,
# bench/attention.py): 1.13, 2.14, 4.16, 8.19 and 16.25 GiB of temporaries at 4, 8, 16, 32 and 64 documents
# (model.attention_max_segments) of one 8,192-token row of 32 query heads of 128 dims. cuDNN works the packed
# layout as rows x documents sequences of the row's length: 8 bytes per (sequence, head, token, head dim)
# gives 1, 2, 4, 8 and 16 GiB, the rest being the benchmark's own arrays (which a step's compile has).
_WORKSPACE_BYTES = 8
_FMHA_CALL = re.compile(r"custom-call\((.*?)\), custom_call_target=\"__cudnn\$fmha[A-Za-z]*\"(.*)")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def cudnn_workspace_bytes(hlo_text: str) -> int:
    """cuDNN's workspace of the largest fused-attention call in a compiled program (0 without cuDNN attention):
    what a compile without the GPU leaves out. Its operands start with q [batch, tokens, heads, head dim] (the
    BTNH layout this project uses); a packed call has the documents' lengths [batch, documents] among them."""
    largest = 0
    for line in hlo_text.splitlines():
        if (match := _FMHA_CALL.search(line)) is None:
            continue
        # Operand shapes: printed with the operands by some XLA versions, else in the layout constraints.
        constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", match.group(2))
        text = constraints.group(1) if constraints else match.group(1)
        arrays = [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(text)]
        if not arrays or len(arrays[0][1]) != 4:
            continue
        batch = arrays[0][1][0]
        lengths = [dims for dtype, dims in arrays[3:] if dtype == "s32" and len(dims) == 2 and dims[0] == batch]
        documents = lengths[0][1] if lengths else 1
        largest = max(largest, _WORKSPACE_BYTES * documents * math.prod(arrays[0][1]))
    return largest


def describe(device) -> str:
    """e.g. "H100 (compile-only, XLA:GPU)"."""
    return f"{table_key(device.device_kind) or device.device_kind} (compile-only, XLA:GPU)"
