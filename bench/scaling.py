"""Scaling table on paper: per-device memory and step time of llama3_8b / 70b / 405b on 8, 64 and 512
H100s, from `llama-jax plan` (compiled here on 8 simulated CPU devices) and a roofline model.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/scaling.py [--mfu 0.45] [--json out.json]

Method (each number printed is one of these, nothing is measured on a GPU):
- Setup: bf16 compute, fp32 params and AdamW moments, sequence 8192, one sequence per data shard,
  remat.policy=full, flash attention (compiled here with the blocked kernel, whose memory matches cuDNN's).
  Mesh: 8B is fsdp=D; 70B and 405B are tensor=8 (one node) with fsdp=D/8.
- Memory per device = 16 bytes x parameters / D (fp32 params, gradients, two Adam moments; ZeRO-3)
  + activations (Korthikanti et al. with full recomputation, see analytic_activation_bytes).
  Beside it, the activations of `llama-jax plan` compiled on 8 CPU devices with 2 and 4 layers
  (per-layer growth x layers + the rest, minus the plan's gradient shards). XLA:CPU keeps more than a
  GPU compile would, e.g. it computes and keeps bf16 matmuls in fp32, so the plan's column is an
  upper bound: compile the plan on the real devices for the real figure.
- Compute time = model FLOPs per device / (989 TFLOP/s dense bf16 x --mfu). The MFU is an
  assumption, default 0.45, between Llama 3's 38–43% and MaxText's ~50%.
- Communication = plan.collective_minimum for the mesh (ring model, bytes per device), each axis's
  bytes at the bandwidth of the tier it crosses, as `llama-jax tune`'s cost model prices them
  (llama_jax/costmodel.py, figures from llama_jax/hardware.py): hosts of 8 GPUs, laid out as
  sharding.make_mesh lays out a multi-host mesh (outer axes across hosts), NVLink at 450 GB/s per
  GPU within a host, the NIC at 50 GB/s per GPU (400 Gb/s) between hosts. Tensor traffic stays
  within a host and sits on the critical path; FSDP traffic crosses hosts beyond 8 GPUs, and the
  latency-hiding scheduler overlaps it with compute.
- Step time = max(compute, fsdp communication) + tensor communication.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SEQ = 8192
HBM = 80 * 2**30
GPUS_PER_HOST = 8


def h100_cost_model():
    """The data-sheet figures `llama-jax tune` uses on an H100 SXM (the MFU is applied by the caller)."""
    from llama_jax.perf import hardware
    from llama_jax.perf.costmodel import CostModel

    memory, link = hardware.table_bandwidth("H100")
    return CostModel(hardware.table_peak_flops("H100", "bfloat16"), memory, link, hardware.NIC_GBS * 1e9)


def mesh_for(preset: str, devices: int) -> dict[str, int]:
    tensor = 1 if preset == "llama3_8b" else 8
    return {"data": 1, "fsdp": devices // tensor, "tensor": tensor, "sequence": 1}


def activation_bytes(preset: str) -> float:
    """Per-device activations and scratch (gradients excluded) for one sequence per data shard, from the
    temporaries of plans compiled with 2 and 4 layers (a 1-layer scan compiles differently)."""
    import jax

    from llama_jax.config import load_config
    from llama_jax.distributed import sharding
    from llama_jax.model.llama import param_count
    from llama_jax.planning.plan import make_plan

    activations, layers = [], (2, 4)
    full = load_config(preset)
    mesh = mesh_for(preset, jax.device_count())
    for n in layers:
        config = load_config(
            preset,
            [
                f"model.n_layers={n}",
                f"train.seq_len={SEQ}",
                "remat.policy=full",
                f"train.batch_size={mesh['fsdp']}",
                "model.compute_dtype=bfloat16",
                "model.attention=blocked",
                *[f"mesh.{k}={v}" for k, v in mesh.items()],
            ],
        )
        plan = make_plan(config, sharding.make_mesh(config))
        gradients = 4 * param_count(config.model) / plan.devices  # fp32 gradient shards, counted with the state
        activations.append(plan.temporary_bytes - gradients)
    per_layer = (activations[1] - activations[0]) / (layers[1] - layers[0])
    return activations[0] + per_layer * (full.model.n_layers - layers[0])


def analytic_activation_bytes(preset: str, mesh: dict[str, int]) -> float:
    """Korthikanti et al. (2022) with full recomputation: every layer keeps its bf16 input (2·s·b·h
    bytes, split over tensor by sequence parallelism), one layer at a time holds its working set
    (34·s·b·h/t), and the fp32 logits and their gradient take 2 x 4·s·b·V/t."""
    from llama_jax.config import load_config

    m = load_config(preset).model
    t, sbh = mesh["tensor"], SEQ * 1 * m.d_model
    return m.n_layers * 2 * sbh / t + 34 * sbh / t + 2 * 4 * SEQ * m.vocab_size / t


def row(preset: str, devices: int, activations: float, mfu: float) -> dict:
    from llama_jax.config import load_config
    from llama_jax.config.choices import MESH_AXES
    from llama_jax.model.flops import train_flops_per_token
    from llama_jax.model.llama import param_count
    from llama_jax.perf.costmodel import cluster_topology
    from llama_jax.planning.plan import collective_minimum

    mesh = mesh_for(preset, devices)
    gpu = h100_cost_model()
    topology = cluster_topology(MESH_AXES, tuple(mesh[a] for a in MESH_AXES), min(devices, GPUS_PER_HOST))
    config = load_config(preset, [f"train.seq_len={SEQ}", f"train.batch_size={mesh['fsdp']}"])
    params = param_count(config.model)
    analytic = analytic_activation_bytes(preset, mesh)
    memory = 16 * params / devices + analytic
    tokens_per_device = SEQ * mesh["fsdp"] / devices  # one sequence per data shard, split over tensor
    flops = train_flops_per_token(config.model, SEQ, causal_skip=True) * tokens_per_device
    compute = flops / (gpu.peak_flops * mfu)
    traffic = collective_minimum(config, mesh)
    fsdp_time = traffic["fsdp"] / gpu.bandwidth(topology.axis_tier("fsdp"))
    tensor_time = traffic["tensor"] / gpu.bandwidth(topology.axis_tier("tensor"))
    step = max(compute, fsdp_time) + tensor_time
    return {
        "preset": preset,
        "devices": devices,
        "mesh": mesh,
        "params": params,
        "memory_gib": memory / 2**30,
        "activations_gib": analytic / 2**30,
        "activations_cpu_plan_gib": activations / 2**30,
        "fits_80gb": memory < HBM,
        "compute_s": compute,
        "fsdp_comm_s": fsdp_time,
        "tensor_comm_s": tensor_time,
        "step_s": step,
        "tokens_per_s_per_device": tokens_per_device / step,
        "mfu_expected": flops / (step * gpu.peak_flops),
        "global_batch_tokens": SEQ * mesh["fsdp"],
        "fsdp_tier": topology.axis_tier("fsdp"),
        "tensor_tier": topology.axis_tier("tensor"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=0.45, help="assumed compute efficiency of the matmuls")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()

    import jax

    if jax.device_count() != 8:
        raise SystemExit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the plans compile on 8 devices)")
    rows = []
    for preset in ("llama3_8b", "llama3_70b", "llama3_405b"):
        activations = activation_bytes(preset)
        rows += [row(preset, d, activations, args.mfu) for d in (8, 64, 512)]
    from llama_jax.perf.costmodel import INTER_HOST, INTRA_HOST

    gpu = h100_cost_model()
    print(
        f"H100 SXM, bf16, seq {SEQ}, one sequence per data shard, remat full, assumed MFU {args.mfu:.0%} "
        f"(compute), {GPUS_PER_HOST} GPUs per host, NVLink {gpu.bandwidth(INTRA_HOST) / 1e9:.0f} GB/s, "
        f"NIC {gpu.bandwidth(INTER_HOST) / 1e9:.0f} GB/s per GPU"
    )
    print(
        f"{'model':<12}{'GPUs':>5}  {'mesh':<22}{'GiB/GPU':>9}{'(act.':>7}{' plan)':>7}{'fits':>6}{'compute':>9}"
        f"{'fsdp comm':>10}{'tp comm':>9}{'step':>8}{'tok/s/GPU':>11}{'MFU':>6}"
    )
    for r in rows:
        mesh = f"fsdp={r['mesh']['fsdp']} tensor={r['mesh']['tensor']}"
        print(
            f"{r['preset']:<12}{r['devices']:>5}  {mesh:<22}{r['memory_gib']:>9.1f}{r['activations_gib']:>7.1f}"
            f"{r['activations_cpu_plan_gib']:>7.1f}{'yes' if r['fits_80gb'] else 'no':>6}"
            f"{r['compute_s']:>8.2f}s{r['fsdp_comm_s']:>9.2f}s{r['tensor_comm_s']:>8.2f}s{r['step_s']:>7.2f}s"
            f"{r['tokens_per_s_per_device']:>11.0f}{100 * r['mfu_expected']:>5.0f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
