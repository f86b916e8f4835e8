"""The step-time cost model of `llama-jax tune`.

predicted step time, per device =
    sum over the compiled step's operations of max(FLOPs / (peak x efficiency),
                                                   bytes read and written / memory bandwidth)
    + (1 - overlap) x collective bytes / link bandwidth

The roofline term (hlo.py lists the operations, every scanned layer counted) charges what a FLOP
count alone misses: optimizer updates over replicated weights, activations stored and read back.
The figures come from hardware.py: data sheets on known GPUs, measurements on CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax

from llama_jax import hardware
from llama_jax.hlo import roofline_seconds

# The defaults `llama-jax tune --efficiency/--overlap` override: the fraction of the peak FLOP/s that
# matmuls reach, and the fraction of communication XLA's latency-hiding scheduler hides behind compute.
GPU_EFFICIENCY, GPU_OVERLAP = 0.7, 0.5
CPU_EFFICIENCY = 0.8


@dataclass(frozen=True)
class CostModel:
    """Predicted step time = a roofline over the compiled step's operations + exposed communication."""

    peak_flops: float  # per device
    memory_bandwidth: float  # bytes/s per device: HBM, or a simulated CPU device's share of DRAM
    link_bandwidth: float  # bytes/s per device for collectives
    efficiency: float = 0.8  # fraction of the peak that matmuls reach
    overlap: float = 0.0  # fraction of communication hidden behind compute

    def predict(self, operations: list, collective_bytes: float) -> float:
        compute = roofline_seconds(operations, self.peak_flops * self.efficiency, self.memory_bandwidth)
        return compute + (1 - self.overlap) * collective_bytes / self.link_bandwidth


def default_cost_model(dtype: str, cache_dir: Path) -> CostModel:
    """Data-sheet figures on known GPUs (matmul efficiency 0.7, half the communication overlapped by XLA's
    latency-hiding scheduler). Elsewhere (CPUs) measured: the matmul peak, and the memory-copy bandwidth for
    both memory and collectives (between simulated devices they are copies), shared by the devices;
    efficiency 0.8 (bench/step.py's profile: matmuls ran at ~78% of the measured peak), no overlap."""
    peak, _ = hardware.device_peak_flops(dtype, cache_dir)
    bandwidth = hardware.table_bandwidth(jax.devices()[0].device_kind)
    if bandwidth is not None:
        return CostModel(peak, *bandwidth, efficiency=GPU_EFFICIENCY, overlap=GPU_OVERLAP)
    measured = hardware.measure_copy_bandwidth()
    return CostModel(peak, measured, measured, efficiency=CPU_EFFICIENCY, overlap=0.0)
