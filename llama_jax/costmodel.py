"""The hardware side of `llama-jax tune`: a step-time cost model, and the figures it needs.

predicted step time, per device =
    sum over the compiled step's operations of max(FLOPs / (peak x efficiency),
                                                   bytes read and written / memory bandwidth)
    + (1 - overlap) x collective bytes / link bandwidth

The roofline term (hlo.py lists the operations, every scanned layer counted) charges what a FLOP
count alone misses: optimizer updates over replicated weights, activations stored and read back.
On known GPUs the figures come from data sheets; on CPUs they are measured here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    """Predicted step time = a roofline over the compiled step's operations + exposed communication."""

    peak_flops: float  # per device
    memory_bandwidth: float  # bytes/s per device: HBM, or a simulated CPU device's share of DRAM
    link_bandwidth: float  # bytes/s per device for collectives
    efficiency: float = 0.8  # fraction of the peak that matmuls reach
    overlap: float = 0.0  # fraction of communication hidden behind compute

    def predict(self, operations: list, collective_bytes: float) -> float:
        from llama_jax.hlo import roofline_seconds

        compute = roofline_seconds(operations, self.peak_flops * self.efficiency, self.memory_bandwidth)
        return compute + (1 - self.overlap) * collective_bytes / self.link_bandwidth


# Data-sheet HBM bandwidth and NVLink (or PCIe) bandwidth per direction, GB/s, by metrics' device keys.
_BANDWIDTH_GBS = {
    "H100": (3350, 450), "H100 PCIe": (2000, 64), "H100 NVL": (3900, 300), "H200": (4800, 450),
    "H200 NVL": (4800, 450), "GH200": (4000, 450), "A100": (2039, 300), "A10": (600, 32), "L4": (300, 32),
    "L40S": (864, 32), "V100": (900, 150), "V100-PCIE": (900, 16), "T4": (320, 16), "B200": (8000, 900),
}


def default_memory_budget() -> float:
    """Bytes per device: 90% of an accelerator's memory; on CPU, 80% of RAM shared by the devices."""
    import jax

    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return 0.9 * limit
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0.8 * total / jax.local_device_count()


def default_cost_model(dtype: str, cache_dir: Path) -> CostModel:
    """Data-sheet figures on known GPUs (matmul efficiency 0.7, half the communication overlapped by XLA's
    latency-hiding scheduler). Elsewhere (CPUs) measured: the matmul peak, and the memory-copy bandwidth for
    both memory and collectives (between simulated devices they are copies), shared by the devices;
    efficiency 0.8 (bench/step.py's profile: matmuls ran at ~78% of the measured peak), no overlap."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from llama_jax.metrics import device_peak_flops, table_key

    peak, _ = device_peak_flops(dtype, cache_dir)
    key = table_key(jax.devices()[0].device_kind)
    if key in _BANDWIDTH_GBS:
        memory, link = _BANDWIDTH_GBS[key]
        return CostModel(peak, memory * 1e9, link * 1e9, efficiency=0.7, overlap=0.5)
    # 128 MiB (far beyond the caches) split over every local device, each scaling its shard at once.
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    array = jax.device_put(np.ones(2**25, np.float32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all")))
    scale = jax.jit(lambda x: x * jnp.float32(1.0001))
    scale(array).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        scale(array).block_until_ready()
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * array.nbytes / best / len(devices)  # read + write, per device
    return CostModel(peak, bandwidth, bandwidth, efficiency=0.8, overlap=0.0)


def simulated_devices() -> bool:
    import jax

    return jax.devices()[0].platform == "cpu" and jax.device_count() > 1 and \
        "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
