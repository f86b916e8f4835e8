"""Joining a multi-process run: JAX's own multi-controller runtime (`jax.distributed`), nothing home-made.

Every process of a run executes the same command; one of them (process 0) hosts JAX's coordination
service at `run.coordinator`, and each knows the process count and its own id. They come from, first
to last:

    run.coordinator, run.num_processes, run.process_id        (config / key=value)
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (environment, e.g. set by launch/)
    JAX's cluster detection: Slurm (srun), Open MPI (mpirun), Cloud TPU

A single process (nothing set, or a detected cluster of one task) does not initialise anything.
On GPU machines with one process per GPU, each process sees only its own GPU (`run.local_device_ids`,
or JAX_LOCAL_DEVICE_IDS, or Slurm's local task id). The coordinator must answer within
`run.init_timeout_s`; when a process dies, the coordination service notices within
`run.heartbeat_timeout_s` and the others stop instead of waiting forever in a collective. Once joined,
peers.py makes every decision the processes must share outside the jitted step.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from dataclasses import dataclass

import jax

from llama_jax.config import RunConfig
from llama_jax.errors import ConfigError, CoordinatorUnavailable

_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


@dataclass(frozen=True)
class Membership:
    """This process's place in the run; `coordinator` None when JAX's cluster detection fills it in."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    detected: str | None  # the cluster kind JAX will detect ("slurm", "ompi", ...), if any


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got '{value}'") from None


def _detected_cluster() -> tuple[str, int] | None:
    """(kind, process count) of a cluster environment JAX can read on its own, if there is one."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_STEP_NODELIST" in os.environ:
        return "slurm", _env_int("SLURM_NTASKS") or 1
    if "OMPI_COMM_WORLD_SIZE" in os.environ and "OMPI_MCA_orte_hnp_uri" in os.environ:
        return "ompi", _env_int("OMPI_COMM_WORLD_SIZE") or 1
    return None


def membership(run: RunConfig) -> Membership | None:
    """Who this process is in a multi-process run, or None for a single-process run. Raises ConfigError."""
    coordinator = run.coordinator or os.environ.get(_ENV["coordinator"], "").strip() or None
    num_processes = run.num_processes or _env_int(_ENV["num_processes"])
    process_id = run.process_id if run.process_id >= 0 else _env_int(_ENV["process_id"])
    detected = _detected_cluster()
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if not explicit:
        if detected is None or detected[1] <= 1:
            return None
        return Membership(None, None, None, detected[0])
    if detected is None and None in (coordinator, num_processes, process_id):
        missing = [
            f"run.{k} (or {_ENV[k]})"
            for k, v in (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
            if v is None
        ]
        raise ConfigError(
            f"a multi-process run needs {', '.join(missing)}; set all three, e.g. "
            "run.coordinator=HOST0:1234 run.num_processes=2 run.process_id=0"
        )
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"run.num_processes must be >= 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(
            f"run.process_id must be in [0, {num_processes}) for {num_processes} processes, got {process_id}"
        )
    if coordinator is not None and not _is_host_port(coordinator):
        raise ConfigError(f"run.coordinator must be HOST:PORT (the address of process 0), got '{coordinator}'")
    if num_processes == 1:
        return None
    return Membership(coordinator, num_processes, process_id, detected[0] if detected else None)


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def local_device_ids(run: RunConfig) -> list[int] | None:
    """The accelerators this process drives (None: all it sees, or JAX's own choice)."""
    if run.local_device_ids:
        return list(run.local_device_ids)
    return None  # JAX_LOCAL_DEVICE_IDS and Slurm's local id are read by jax.distributed itself


def initialize(run: RunConfig) -> Membership | None:
    """Join the run described by `run` and the environment; a no-op for a single process, and for a
    process that has already joined (a second `train` call in one script).

    Raises ConfigError on inconsistent settings and CoordinatorUnavailable when the coordinator does
    not answer within run.init_timeout_s.
    """
    member = membership(run)
    if member is None or jax.distributed.is_initialized():
        return member
    if member.coordinator is not None and member.process_id != 0:
        # JAX aborts the process (no exception to catch) when the coordinator never answers; a plain
        # TCP probe first turns the common case, a wrong address or a coordinator not up, into one line.
        wait_for_coordinator(member.coordinator, run.init_timeout_s, member.process_id)
    print(
        f"joining the run at {member.coordinator or member.detected} as process "
        f"{'(detected)' if member.process_id is None else member.process_id} of "
        f"{member.num_processes or '(detected)'}",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=member.coordinator,
            num_processes=member.num_processes,
            process_id=member.process_id,
            local_device_ids=local_device_ids(run),
            initialization_timeout=int(run.init_timeout_s),
            heartbeat_timeout_seconds=int(run.heartbeat_timeout_s),
        )
    except Exception as err:  # jaxlib raises its own runtime error types; keep the first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = member.coordinator or f"the coordinator {member.detected} names"
        raise CoordinatorUnavailable(
            f"could not join the run at {where} within {run.init_timeout_s:g}s as process "
            f"{member.process_id if member.process_id is not None else '?'} ({first[:300]}); check that "
            "process 0 is running and the address and port are reachable from this host"
        ) from None
    return member


def wait_for_coordinator(address: str, timeout_s: float, process_id: int | None) -> None:
    """Return once a TCP connection to address succeeds; CoordinatorUnavailable after timeout_s."""
    host, _, port = address.rpartition(":")
    deadline, last_error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            last_error = err
            time.sleep(0.5)
    raise CoordinatorUnavailable(
        f"process {process_id} could not reach the coordinator at {address} within {timeout_s:g}s "
        f"({last_error}); check that process 0 is running there and the port is open to this host "
        "(run.coordinator, run.init_timeout_s)"
    )


def on_fewer_processes(config, processes: int, say: bool = True):
    """`config` for a run on `processes` of its run.full_processes: train.microbatches multiplied by their ratio
    (the global batch and each micro-batch's rows per device as on all of them), said on stderr when `say`. Raises
    ConfigError."""
    full, microbatches = config.run.full_processes, config.train.microbatches
    if full <= processes or microbatches == "auto":
        return config
    if full % processes or config.train.batch_size % (microbatches * (full // processes)):
        raise ConfigError(
            f"run.full_processes={full} on {processes} processes: train.batch_size "
            f"{config.train.batch_size} cannot be split into {microbatches} x {full}/{processes} "
            "micro-batches; run on a count of processes that divides run.full_processes"
        )
    train = dataclasses.replace(config.train, microbatches=microbatches * (full // processes))
    if say:
        print(
            f"running on {processes} of {full} processes (run.full_processes): train.microbatches "
            f"{microbatches} -> {train.microbatches}, the same global batch",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(config, train=train)


def node_name() -> str:
    """The name the scheduler knows this host by, to exclude it: Kubernetes' node (LLAMA_JAX_NODE_NAME, which
    launch/k8s.sh sets from spec.nodeName; a pod's host name is the pod's), Slurm's (SLURMD_NODENAME), else
    the host name."""
    return os.environ.get("LLAMA_JAX_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
