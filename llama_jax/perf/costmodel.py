"""The step-time cost model of `llama-jax tune`, and which links a step's collectives cross.

predicted step time, per device =
    sum over the compiled step's operations of max(FLOPs / (peak x efficiency)
                                                     + fp8 FLOPs / (fp8 peak x efficiency),
                                                   bytes read and written / memory bandwidth)
    + (1 - overlap) x sum over link tiers of collective bytes on the tier / the tier's bandwidth

The roofline term (hlo.py lists the operations, every scanned layer counted) charges what a FLOP
count alone misses: optimizer updates over replicated weights, activations stored and read back.
The figures come from hardware.py: data sheets on known GPUs, measurements on CPUs. FLOPs of matmuls
with fp8 operands (model.fp8) are priced at the data sheet's fp8 peak, the rest at the compute dtype's;
a device without an fp8 figure (a CPU) prices them all at the latter.

Link tiers. A collective whose every group of devices sits on one host runs over the host's links
(NVLink, or PCIe, per hardware.py's table): the intra-host tier. One whose groups span hosts is
inter-host: its bytes go through the NICs at min(NIC, host link) per device, since they also cross
the device's own link to reach its NIC. The whole collective is priced at the slowest tier that any
of its groups crosses. That is what NCCL's ring achieves across hosts (every device sends its bytes
through the ring, whose slowest hops are the NICs); its hierarchical variants, which move part of
the bytes over NVLink first, are not modelled. Which axes cross hosts follows sharding.make_mesh:
the outermost mesh axes (pipeline, data, then fsdp, sequence, tensor) are split over hosts first.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.perf import hardware
from llama_jax.perf.hlo import KINDS, DeviceGroups, roofline_seconds

# The defaults `llama-jax tune --efficiency/--overlap` override: the fraction of the peak FLOP/s that
# matmuls reach, and the fraction of communication XLA's latency-hiding scheduler hides behind compute.
GPU_EFFICIENCY, GPU_OVERLAP = 0.7, 0.5
CPU_EFFICIENCY = 0.8
INTRA_HOST, INTER_HOST = "intra-host", "inter-host"
TIERS = (INTRA_HOST, INTER_HOST)


@dataclass(frozen=True)
class CostModel:
    """Predicted step time = a roofline over the compiled step's operations + exposed communication."""

    peak_flops: float  # per device
    memory_bandwidth: float  # bytes/s per device: HBM, or a simulated CPU device's share of DRAM
    link_bandwidth: float  # bytes/s per device between the devices of one host (NVLink or PCIe)
    nic_bandwidth: float  # bytes/s per device between hosts: its share of the hosts' NICs
    efficiency: float = 0.8  # fraction of the peak that matmuls reach
    overlap: float = 0.0  # fraction of communication hidden behind compute
    fp8_peak_flops: float | None = None  # per device, for matmuls with fp8 operands; None: at peak_flops

    def compute_seconds(self, operations: list) -> float:
        """The roofline over the operations: (flops, bytes[, fp8 flops]) each, per device per step."""
        return roofline_seconds(
            operations,
            self.peak_flops * self.efficiency,
            self.memory_bandwidth,
            self.fp8_peak_flops and self.fp8_peak_flops * self.efficiency,
        )

    def bandwidth(self, tier: str) -> float:
        """Bytes/s per device on a tier; between hosts the bytes cross the device's link to the NIC too."""
        return self.link_bandwidth if tier == INTRA_HOST else min(self.nic_bandwidth, self.link_bandwidth)

    def communication_seconds(self, tier_bytes: Mapping[str, float]) -> float:
        return sum(nbytes / self.bandwidth(tier) for tier, nbytes in tier_bytes.items())

    def predict(self, operations: list, tier_bytes: Mapping[str, float]) -> float:
        """tier_bytes: collective bytes per device per step on each tier (tier_totals of traffic_by_axis)."""
        return self.compute_seconds(operations) + (1 - self.overlap) * self.communication_seconds(tier_bytes)


def default_cost_model(dtype: str, cache_dir: Path, device=None) -> CostModel:
    """Data-sheet figures on known GPUs (their fp8 peak too; matmul efficiency 0.7, half the communication
    overlapped by XLA's latency-hiding scheduler). Elsewhere (CPUs) measured: the matmul peak, and the memory-copy
    bandwidth for both memory and collectives (between simulated devices they are copies), shared by the devices;
    efficiency 0.8 (bench/step.py's profile: matmuls ran at ~78% of the measured peak), no overlap.
    Between hosts hardware.NIC_GBS per device, everywhere (on CPUs the copy bandwidth is the slower). `device`: a
    compile-only GPU's (gpu_target.py) instead of this process's."""
    peak, _ = hardware.device_peak_flops(dtype, cache_dir, device)
    # This process's device: jax.devices()[0] belongs to process 0.
    kind = (device or jax.local_devices()[0]).device_kind
    if hardware.table_bandwidth(kind) is not None:
        return _gpu_model(peak, kind)
    nic = hardware.NIC_GBS * 1e9
    measured = hardware.measure_copy_bandwidth()
    return CostModel(peak, measured, measured, nic, efficiency=CPU_EFFICIENCY, overlap=0.0)


def data_sheet_cost_model(dtype: str, device_kind: str) -> CostModel | None:
    """The cost model of a device with a data sheet (default_cost_model's GPU case), or None: nothing is measured."""
    peak = hardware.table_peak_flops(device_kind, dtype)
    return None if peak is None or hardware.table_bandwidth(device_kind) is None else _gpu_model(peak, device_kind)


def _gpu_model(peak: float, device_kind: str) -> CostModel:
    return CostModel(
        peak,
        *hardware.table_bandwidth(device_kind),
        hardware.NIC_GBS * 1e9,
        efficiency=GPU_EFFICIENCY,
        overlap=GPU_OVERLAP,
        fp8_peak_flops=hardware.table_fp8_peak_flops(device_kind),
    )


# --------------------------------------------------------------------------------------------
# Which mesh axes, and which tier, each collective crosses


@dataclass(frozen=True)
class Topology:
    """A mesh's axes and the host of each of its devices, in mesh.devices.flat order: the positions
    that a compiled SPMD program's replica groups name (hlo.device_groups)."""

    axis_names: tuple[str, ...]  # outermost first
    shape: tuple[int, ...]
    hosts: tuple[int, ...]  # host number of each device position

    @property
    def host_count(self) -> int:
        return len(set(self.hosts))

    def coordinates(self, position: int) -> tuple[int, ...]:
        coords = []
        for size in reversed(self.shape):
            position, coord = divmod(position, size)
            coords.append(coord)
        return tuple(reversed(coords))

    def axis_tier(self, axis: str) -> str:
        """The tier of a collective over this axis alone: inter-host if the axis spans hosts anywhere."""
        i = self.axis_names.index(axis)
        stride = math.prod(self.shape[i + 1 :])
        crosses = any(
            self.hosts[p] != self.hosts[p - (p // stride % self.shape[i]) * stride] for p in range(len(self.hosts))
        )
        return INTER_HOST if crosses else INTRA_HOST


def check_devices_per_host(devices_per_host: int, devices: int) -> None:
    if devices_per_host < 0 or (devices_per_host and devices % devices_per_host):
        divisors = [d for d in range(1, devices + 1) if devices % d == 0]
        raise ConfigError(
            f"--devices-per-host {devices_per_host} does not divide the {devices} devices into "
            f"hosts; use one of {', '.join(map(str, divisors))}"
        )


def cluster_topology(axis_names: tuple[str, ...], shape: tuple[int, ...], devices_per_host: int) -> Topology:
    """Hosts of `devices_per_host` devices, laid out as sharding.make_mesh lays out a multi-host mesh: each
    axis's index is (across-host part, within-host part), the outermost axes crossing hosts first."""
    devices = math.prod(shape)
    check_devices_per_host(devices_per_host, devices)
    # Never None: the host count divides the device count, so each of its prime factors is found in the axes.
    inner, outer = sharding.split_over_hosts(tuple(shape), devices // (devices_per_host or devices))
    hosts = []
    for coords in itertools.product(*map(range, shape)):
        host = 0
        for c, within, across in zip(coords, inner, outer):
            host = host * across + c // within
        hosts.append(host)
    return Topology(tuple(axis_names), tuple(shape), tuple(hosts))


def mesh_topology(mesh: Mesh, devices_per_host: int = 0) -> Topology:
    """devices_per_host = 0: the hosts are the processes the mesh's devices belong to (launch/ starts one
    process per host). Otherwise a planned cluster of hosts with that many devices (cluster_topology)."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    if devices_per_host:
        return cluster_topology(names, shape, devices_per_host)
    processes = [d.process_index for d in mesh.devices.flat]
    number = {p: i for i, p in enumerate(sorted(set(processes)))}
    return Topology(names, shape, tuple(number[p] for p in processes))


@dataclass(frozen=True)
class AxisTraffic:
    """Collective bytes sent per device per step by one kind of collective over one set of mesh axes."""

    axes: tuple[str, ...]  # the mesh axes its device groups span, outermost first
    kind: str  # hlo.KINDS
    tier: str  # INTRA_HOST or INTER_HOST
    bytes: float


def traffic_by_axis(
    collective_groups: Mapping[tuple[str, DeviceGroups], float], topology: Topology
) -> tuple[AxisTraffic, ...]:
    """hlo.HloStats.collective_groups attributed to mesh axes and tiers: a group spans the axes along which
    its devices' coordinates differ. The rows of one kind sum to hlo's total for that kind."""
    totals: dict[tuple[tuple[int, ...], str, str], float] = defaultdict(float)  # (axis indices, kind, tier)
    for (kind, groups), sent in collective_groups.items():
        if not sent:
            continue
        spanned = set()
        for group in groups:
            coords = [topology.coordinates(d) for d in group]
            spanned |= {i for i in range(len(topology.shape)) if len({c[i] for c in coords}) > 1}
        crosses = any(len({topology.hosts[d] for d in group}) > 1 for group in groups)
        totals[tuple(sorted(spanned)), kind, INTER_HOST if crosses else INTRA_HOST] += sent
    rows = sorted(totals.items(), key=lambda row: (KINDS.index(row[0][1]), row[0][0], TIERS.index(row[0][2])))
    return tuple(
        AxisTraffic(tuple(topology.axis_names[i] for i in axes), kind, tier, nbytes)
        for (axes, kind, tier), nbytes in rows
    )


def tier_totals(traffic: tuple[AxisTraffic, ...]) -> dict[str, float]:
    """Collective bytes per device per step on each tier (both tiers always present)."""
    return {tier: sum(t.bytes for t in traffic if t.tier == tier) for tier in TIERS}


def spearman(a: list[float], b: list[float]) -> float | None:
    """Rank correlation of two equally long lists (None for fewer than 3 pairs or constant ranks)."""
    if len(a) < 3:
        return None

    def rank(xs):  # ties are rare in timings
        return [sorted(xs).index(x) for x in xs]

    ra, rb = rank(a), rank(b)
    mean = (len(a) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var if var else None
