"""What several commands parse alike: `[PRESET|CONFIG.yaml] [key=value ...]`, comma-separated integers, and
`--target GPU --gpus N [--gpus-per-host G]` (a cluster of compile-only GPUs); --devices-per-host's help."""

from __future__ import annotations

import argparse
import os

from llama_jax.errors import InputError

DEVICES_PER_HOST_HELP = (
    "devices per host, to tell which collectives cross the network between hosts; must divide "
    "the device count (default: the processes the devices belong to, one per host as launch/ "
    "starts them; e.g. 8 plans a cluster of 8-GPU hosts on simulated devices)"
)


def split_source(args: list[str]) -> tuple[str | None, list[str]]:
    """`[PRESET|CONFIG.yaml] [key=value ...]` -> (source, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def int_list(text: str, least: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got '{text}'")
    return values


def target_gpus(ns: argparse.Namespace) -> tuple:
    """--target GPU --gpus N [--gpus-per-host G]: compile-only GPUs of that cluster (perf/gpu_target.py), or ()."""
    if not ns.target:
        if ns.gpus or ns.gpus_per_host:
            raise InputError("--gpus and --gpus-per-host plan a cluster of --target GPUs, e.g. --target h100 --gpus 32")
        return ()
    if ns.devices_per_host:
        raise InputError("--devices-per-host is for simulated devices; with --target the hosts are --gpus-per-host")
    if not ns.gpus:
        raise InputError(f"--target {ns.target} needs --gpus N: how many GPUs the run has")
    # The compile needs no local GPU, and without a driver the CUDA plugin registers only on a CPU-only jax.
    if not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
    from llama_jax.perf import gpu_target

    return tuple(gpu_target.devices(ns.target, ns.gpus, ns.gpus_per_host))


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        help="h100, h200, a100 or b200: compile with XLA:GPU for a cluster of these "
        "GPUs, on any machine (needs the gpu extra: Python >= 3.12)",
    )
    parser.add_argument("--gpus", type=int, default=0, help="with --target: the GPUs of the run")
    parser.add_argument("--gpus-per-host", type=int, default=0, help="with --target: GPUs per host (default 8)")
