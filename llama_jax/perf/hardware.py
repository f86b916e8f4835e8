"""What the hardware can do: peak FLOP/s, memory and link bandwidth, and the memory budget of a device.

Figures come from vendor data sheets (dense, never the 2x "with sparsity" numbers) for the devices in
the tables below. Elsewhere (always on CPUs) they are measured on this machine: a timed matmul for the
peak, re-measured each run and kept as the best seen per machine and software, and a timed copy for
the bandwidth. MFU, `llama-jax plan` and `llama-jax tune`'s cost model all read them from here.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.files import atomic_path

# Peak dense TFLOP/s of ONE jax device as (bf16, fp16, fp32); None = no figure we trust -> measure.
# fp32 is the plain CUDA-core figure, not TF32. Note JAX's default matmul precision may use TF32 on
# Ampere+, so fp32 "MFU" can then exceed 100%; set jax_default_matmul_precision=highest to compare.
# Sources (dense columns): NVIDIA H100 data sheet (SXM / PCIe / NVL), H200 data sheet (SXM / NVL;
# GH200 has the H100/H200 SXM GPU), A100 40/80GB data sheet (SXM = PCIe peaks), A10, L4 and L40S data
# sheets (their tensor figures marked * are sparse: halved here), V100 (SXM2 / PCIe) and T4 data
# sheets (fp16 tensor cores, no bf16), HGX B200 data sheet (per GPU = 1/8; fp32 left to measurement),
# AMD Instinct MI300X data sheet, Google Cloud TPU system-architecture pages (bf16 per chip; v2/v3
# expose each of a chip's 2 cores as a jax device, hence half the chip figure).
# "A10G" (AWS) is deliberately absent: no vendor data sheet, so it is measured.
_PEAK_TFLOPS: dict[str, tuple[float | None, float | None, float | None]] = {
    "H100": (989.0, 989.0, 67.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100 NVL": (835.0, 835.0, 60.0),
    "H200": (989.0, 989.0, 67.0),
    "H200 NVL": (835.0, 835.0, 60.0),
    "GH200": (989.0, 989.0, 67.0),
    "A100": (312.0, 312.0, 19.5),
    "A10": (125.0, 125.0, 31.2),
    "L4": (121.0, 121.0, 30.3),
    "L40S": (362.0, 362.0, 91.6),
    "V100": (None, 125.0, 15.7),
    "V100-PCIE": (None, 112.0, 14.0),
    "T4": (None, 65.0, 8.1),
    "B200": (2250.0, 2250.0, None),
    "MI300X": (1307.4, 1307.4, 163.4),
    "TPU v2": (22.5, None, None),
    "TPU v3": (61.5, None, None),
    "TPU v4": (275.0, None, None),
    "TPU v5 lite": (197.0, None, None),
    "TPU v5e": (197.0, None, None),  # jax says "v5 lite"
    "TPU v5": (459.0, None, None),
    "TPU v5p": (459.0, None, None),
    "TPU v6 lite": (918.0, None, None),
    "TPU v6e": (918.0, None, None),
}
# Peak dense fp8 (e4m3/e5m2 operands) TFLOP/s of ONE device, keyed like the table above; absent = no fp8 tensor
# cores or no figure we trust (A100, A10, V100, T4 have none; TPUs are left out). Sources, dense (half the data
# sheets' "with sparsity" figures): NVIDIA H100 data sheet (SXM 3,958*, PCIe 3,026*, NVL 3,341*), H200 data sheet
# (SXM 3,958*, NVL 3,341*; GH200 has the SXM GPU), L40S (1,466*) and L4 (485*) data sheets, HGX B200 data sheet
# (72 PFLOPS* for 8 GPUs), AMD Instinct MI300X data sheet (5,229.8* TFLOPS with sparsity).
_FP8_PEAK_TFLOPS: dict[str, float] = {
    "H100": 1979.0,
    "H100 PCIe": 1513.0,
    "H100 NVL": 1671.0,
    "H200": 1979.0,
    "H200 NVL": 1671.0,
    "GH200": 1979.0,
    "L40S": 733.0,
    "L4": 242.5,
    "B200": 4500.0,
    "MI300X": 2614.9,
}
_COLUMN = {"bfloat16": 0, "float16": 1, "float32": 2}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # how tables name them


def _dtype_name(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _COLUMN:
        raise ValueError(f"compute dtype must be one of {sorted(_COLUMN)}, got {dtype!r}")
    return name


def table_key(device_kind: str) -> str | None:
    """The data-sheet name of a device kind (e.g. "NVIDIA H100 80GB HBM3" -> "H100"), or None: the longest
    table key found in device_kind as a whole word ("L4" must not match "L40S")."""
    kind = device_kind.lower()
    hits = [k for k in _PEAK_TFLOPS if re.search(rf"(?<![a-z0-9]){re.escape(k.lower())}(?![a-z0-9])", kind)]
    return max(hits, key=len) if hits else None


def table_peak_flops(device_kind: str, dtype: str) -> float | None:
    """Data-sheet dense peak FLOP/s of one device of this kind, or None if unknown."""
    column = _COLUMN[_dtype_name(dtype)]  # validate dtype even for unknown devices
    key = table_key(device_kind)
    tflops = None if key is None else _PEAK_TFLOPS[key][column]
    return None if tflops is None else tflops * 1e12


def table_fp8_peak_flops(device_kind: str) -> float | None:
    """Data-sheet dense fp8 peak FLOP/s of one device of this kind, or None: no fp8 tensor cores, or no figure."""
    tflops = _FP8_PEAK_TFLOPS.get(table_key(device_kind) or "")
    return None if tflops is None else tflops * 1e12


def matmul_operands(size: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two (size, size) host arrays of `dtype` to time a chain of products x @ b with: `a` of unit variance, `b`
    scaled by 1/sqrt(size) so the chain keeps it (no overflow, no subnormals). Drawn by numpy, since eager
    jax.random compiles its own programs first (0.4 s of a process's start); columns repeat every 1024 (a
    matmul's speed does not depend on the values), so a GPU's 8192^2 is drawn quickly too."""
    rng = np.random.default_rng(0)

    def operand(scale: float) -> np.ndarray:
        block = rng.standard_normal((size, min(size, 1024)), np.float32) * np.float32(scale)
        return np.tile(block, (1, -(-size // block.shape[1])))[:, :size].astype(dtype)

    return operand(1.0), operand(1 / math.sqrt(size))


def measure_matmul_peak(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted square matmul on the default device: best of `repeats` timed chains."""
    chain = 4  # back-to-back matmuls per timing, so dispatch overhead is amortised
    a, b = (jnp.asarray(x) for x in matmul_operands(size, dtype))
    matmul = jax.jit(jnp.matmul)

    def run() -> None:
        x = a
        for _ in range(chain):  # each product feeds the next: none can be skipped or overlapped
            x = matmul(x, b)
        x.block_until_ready()

    run()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return chain * 2.0 * size**3 / best


# Measured peaks: the matmul size. On a GPU a small matmul is bound by kernel launches, not by the tensor
# cores, so an unknown GPU gets 8192^3 (about 1.1 TFLOP, milliseconds on any recent GPU); on a CPU 1024^3
# already keeps every core busy, and the measurement stays well under a second.
MEASURED_MATMUL_SIZE = {"gpu": 8192, "cpu": 1024}


def device_peak_flops(dtype: str, cache_dir: pathlib.Path, device: Any = None) -> tuple[float, str]:
    """Peak FLOP/s of ONE of this process's devices (or of `device`, a compile-only GPU's: its data sheet) for
    `dtype`, and where the figure came from.

    Known devices: the data sheet. Unknown ones (always CPUs) are measured on every call, a large matmul
    timed in well under a second, and the figure is the best ever seen on this machine and software
    (cache_dir/peak_flops.json keeps it): a run on a busy machine can neither lower the denominator of
    MFU for later runs nor report an inflated MFU itself, and an idle moment raises it for good. One CPU
    device already uses every core, so the measurement is the whole machine's peak; simulated CPU devices
    (--xla_force_host_platform_device_count=N) share those cores, so each is credited with 1/N of it and
    MFU over N devices still divides by the machine's peak.
    """
    dtype = _dtype_name(dtype)
    device = device or jax.local_devices()[0]  # this process's: jax.devices()[0] belongs to process 0
    key = table_key(device.device_kind)
    peak = table_peak_flops(device.device_kind, dtype)
    if peak is not None:
        return peak, f"{key} table, {dtype} dense"
    size = MEASURED_MATMUL_SIZE.get(device.platform, MEASURED_MATMUL_SIZE["gpu"])
    where = f"measured {SHORT_DTYPE[dtype]} {size}^3 matmul on {device.device_kind}, best seen"
    sharing = jax.local_device_count() if device.platform == "cpu" else 1
    if sharing > 1:
        where += f", split over {sharing} simulated devices sharing the cores"
    cache_key = "|".join(
        [
            device.platform,
            device.device_kind,
            str(os.cpu_count()),
            jax.__version__,
            dtype,
            os.environ.get("XLA_FLAGS", ""),
        ]
    )
    path = cache_dir / "peak_flops.json"
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):  # missing or corrupt: start again
        cache = {}
    cached = cache.get(cache_key)
    best_seen = float(cached) if isinstance(cached, (int, float)) and cached > 0 else 0.0
    # With a figure kept, this measurement can only raise it: one timed chain after the warm-up is enough (0.13 s
    # less at every start on 2 CPU cores); the first measurement on a machine takes the best of three.
    peak = max(best_seen, measure_matmul_peak(dtype, size=size, repeats=1 if best_seen else 3))
    if peak > best_seen:
        cache[cache_key] = peak
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:  # a concurrent reader or a crash never sees half a cache
                tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), encoding="utf-8")
        except OSError:  # read-only or full disk: the figure is still right, just not kept
            where += ", not cached"
    return peak / sharing, where


@dataclass(frozen=True)
class MfuPeaks:
    """The per-device peaks that MFU is reported against. Always the compute dtype's (bf16 on GPUs): the figure
    other frameworks report, torchtitan's and Megatron's fp8 runs included, so MFUs compare across runs and
    recipes. Under model.fp8 also the fp8 peak, the one that the fp8 projections' matmuls could reach: an fp8
    step's MFU against it is the lower bound of how busy the tensor cores were (the rest of its matmuls, attention
    and the output projection, run in bf16 at half that rate)."""

    compute: float
    compute_source: str
    fp8: float | None = None  # None: model.fp8=none, or no fp8 figure for this device (fp8_source says which)
    fp8_source: str = ""

    @classmethod
    def with_fp8(cls, compute: float, compute_source: str, fp8_recipe: str, device_kind: str) -> MfuPeaks:
        """The compute dtype's peak as given, and the fp8 one where model.fp8 (fp8_recipe) is on."""
        if fp8_recipe == "none":
            return cls(compute, compute_source)
        fp8 = table_fp8_peak_flops(device_kind)
        if fp8 is None:
            return cls(compute, compute_source, None, f"no fp8 peak for {device_kind}: MFU against fp8 not reported")
        return cls(compute, compute_source, fp8, f"{table_key(device_kind)} table, fp8 dense")

    def fractions(self, model_flops_per_s: float, devices: int) -> dict[str, float | None]:
        """{"mfu": against the compute dtype's peak, "mfu_fp8": against the fp8 peak, or None without one}."""
        if self.compute <= 0 or devices < 1:
            raise ValueError(f"need a peak > 0 and devices >= 1, got {self.compute}, {devices}")
        return {
            "mfu": model_flops_per_s / (self.compute * devices),
            "mfu_fp8": model_flops_per_s / (self.fp8 * devices) if self.fp8 else None,
        }

    def describe(self) -> str:
        def rate(flops: float) -> str:
            return f"{flops / 1e12:.4g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"

        text = f"peak {rate(self.compute)} per device ({self.compute_source})"
        if self.fp8:
            return f"{text}, fp8 {rate(self.fp8)} ({self.fp8_source})"
        return f"{text}; {self.fp8_source}" if self.fp8_source else text


def mfu_peaks(compute_dtype: str, fp8_recipe: str, cache_dir: pathlib.Path, device: Any = None) -> MfuPeaks:
    """The peaks MFU is reported against (MfuPeaks): fp8_recipe is model.fp8. An fp8 peak comes only from a data
    sheet: a CPU has none (XLA:CPU computes fp8 matmuls in wider types), nor do GPUs without fp8 tensor cores."""
    compute, compute_source = device_peak_flops(compute_dtype, cache_dir, device)
    return MfuPeaks.with_fp8(compute, compute_source, fp8_recipe, (device or jax.local_devices()[0]).device_kind)


# Data-sheet HBM bandwidth and NVLink (or PCIe) bandwidth per direction, GB/s, keyed like the peak table.
_BANDWIDTH_GBS = {
    "H100": (3350, 450),
    "H100 PCIe": (2000, 64),
    "H100 NVL": (3900, 300),
    "H200": (4800, 450),
    "H200 NVL": (4800, 450),
    "GH200": (4000, 450),
    "A100": (2039, 300),
    "A10": (600, 32),
    "L4": (300, 32),
    "L40S": (864, 32),
    "V100": (900, 150),
    "V100-PCIE": (900, 16),
    "T4": (320, 16),
    "B200": (8000, 900),
}
# Between hosts, GB/s per device per direction: one 400 Gb/s NIC per GPU (the NVIDIA DGX H100/H200 and
# HGX reference design's eight ConnectX-7 400 Gb/s InfiniBand/Ethernet ports for eight GPUs) = 50 GB/s.
# The default of `llama-jax tune --nic-gbs`; bench/scaling.py uses it too.
NIC_GBS = 50.0


# What XLA:GPU needs to compile for a GPU it cannot see (perf/gpu_target.py writes XLA's target config from it):
# the published figures of the SXM parts. Sources: NVIDIA's H100 and H200 data sheets and the Hopper tuning guide
# (132 SMs, 50 MB L2, 228 KB shared memory per SM of which 227 KB for one block, 128 FP32 cores per SM, 1,980 MHz
# max boost); the A100 data sheet and Ampere tuning guide (108 SMs, 40 MB L2, 164 / 163 KB, 64 FP32 cores, 1,410
# MHz); the HGX B200 data sheet and Blackwell tuning guide (148 SMs, 180 GB, 126 MB L2, Hopper's shared memory;
# NVIDIA publishes no clock: 1,855 MHz is its dense bf16 peak / (148 SMs x 8,192 FLOP per clock)). Memory is
# the data sheet's capacity (80 GB parts expose ~79.6 GiB). CUDA and cuDNN are those of the GPU image whose H100
# figures are in docs/performance.md (CUDA 13, cuDNN 9.19).
@dataclass(frozen=True)
class GpuSpec:
    name: str  # as the CUDA driver names the device (jax's device_kind)
    compute_capability: str
    sms: int
    memory_gib: float
    boost_ghz: float
    l2_mib: float
    shared_kib_per_sm: int
    shared_kib_per_block: int  # the opt-in maximum of one thread block
    fp32_cores_per_sm: int
    cuda: str = "13.0"
    cudnn: str = "9.19.0"


GPU_SPECS = {
    "H100": GpuSpec("NVIDIA H100 80GB HBM3", "9.0", 132, 80, 1.98, 50, 228, 227, 128),
    "H200": GpuSpec("NVIDIA H200", "9.0", 132, 141, 1.98, 50, 228, 227, 128),
    "A100": GpuSpec("NVIDIA A100-SXM4-80GB", "8.0", 108, 80, 1.41, 40, 164, 163, 64),
    "B200": GpuSpec("NVIDIA B200", "10.0", 148, 180, 1.855, 126, 228, 227, 128),
}


def table_bandwidth(device_kind: str) -> tuple[float, float] | None:
    """(memory, link) bytes/s of one device of this kind from its data sheet, or None if unknown."""
    key = table_key(device_kind)
    if key not in _BANDWIDTH_GBS:
        return None
    memory, link = _BANDWIDTH_GBS[key]
    return memory * 1e9, link * 1e9


def measure_copy_bandwidth() -> float:
    """Bytes/s per local device of a scale (read + write) over 128 MiB split over every local device,
    each scaling its shard at once: far beyond the caches, so it is memory bandwidth."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    array = jax.device_put(
        np.ones(2**25, np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
    )
    scale = jax.jit(lambda x: x * jnp.float32(1.0001))
    scale(array).block_until_ready()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        scale(array).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * array.nbytes / best / len(devices)


def memory_budget(device_memory_gb: float = 0.0, device: Any = None) -> float:
    """Bytes per device a step may use: run.device_memory_gb, or (0) default_memory_budget(device)."""
    return device_memory_gb * 2**30 if device_memory_gb > 0 else default_memory_budget(device)


# XLA_PYTHON_CLIENT_MEM_FRACTION under launch/gpu_env.sh: the share of a GPU that XLA's allocator may use.
GPU_MEMORY_FRACTION = 0.9


def compile_only(device: Any) -> bool:
    """Whether `device` is one that is compiled for but not here: a GPU of a planned cluster (gpu_target.py)."""
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform in this process at all
        return True


def default_memory_budget(device: Any = None) -> float:
    """Bytes per device (default: this process's first): on an accelerator, what XLA may allocate there (its
    allocator's limit: 90% of a GPU under launch/gpu_env.sh, JAX's default 75% otherwise); on a GPU that is only
    compiled for, 90% of its data-sheet memory, as under launch/gpu_env.sh; on CPU, 80% of RAM shared by the
    devices."""
    device = device or jax.local_devices()[0]  # this process's: jax.devices()[0] belongs to process 0
    if compile_only(device):
        key = table_key(device.device_kind)
        if key not in GPU_SPECS:
            raise ValueError(f"no memory figure for {device.device_kind}: give run.device_memory_gb")
        return GPU_MEMORY_FRACTION * GPU_SPECS[key].memory_gib * 2**30
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return float(limit)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0.8 * total / jax.local_device_count()


def simulated_devices() -> bool:
    """Whether the devices are CPU devices simulated with --xla_force_host_platform_device_count."""
    return (
        jax.local_devices()[0].platform == "cpu"
        and jax.device_count() > 1
        and "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    )
