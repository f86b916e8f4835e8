"""The pre-flight check's suspects, measured again in rounds that the whole fleet runs at the same moments.

The first look (preflight.py) makes a device below fault.preflight_min_ratio x the fleet's median a suspect, not
yet a verdict: it compares hosts that were measured at different moments, and a host busy for a few seconds
(its data workers, a page-cache flush, a neighbour's job, another test on a CI machine) slows every device it
has. Excluding a healthy node costs a resubmission and a node; so every suspect is measured again:

- Up to ROUNDS rounds, ROUND_GAP_S apart, so that they spread over a window that a short burst of load cannot
  fill. Each round opens with a barrier: every process measures at the same moment, its suspects and one
  reference device (the process's median one), one timed call each.
- In each round a suspect's figures are divided by the median of the references' figures of that round: load
  that the whole fleet shares moves that median with it.
- A suspect is named only if it is slow (below the ratio in matmul rate or memory bandwidth) in most rounds;
  the rounds stop as soon as every suspect's majority is decided, so a plain verdict either way costs
  ROUNDS // 2 + 1 rounds.
- A host whose every measured device was slow in some round (the first look counts) and none of whose devices
  is named was loaded during the check: it is reported, not excluded.

Every process gathers the same figures (Peers.reduce) and so decides the same. Each suspect's per-round ratios
go into the report and the verdict file, so a user can see why a host was named or cleared.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llama_jax.distributed.peers import Peers

ROUNDS = 3  # most rounds: named when slow in ROUNDS // 2 + 1 of them
ROUND_GAP_S = 1.0  # the pause before each round: the rounds span about ROUNDS seconds, whatever the platform
METRICS = {"matmul": "matmul_flops", "memory": "memory_bytes_s"}  # ratio name -> figure


@dataclass(frozen=True)
class Recheck:
    """The rounds' outcome, the same on every process."""

    suspects: list[dict]  # host, process, device; ratios {matmul, memory: [first look, round 1, ...]}; named
    loaded: list[dict]  # hosts loaded during the check: host, processes, devices, loaded_rounds, rounds
    rounds: int  # rounds run

    @property
    def named(self) -> set[int]:
        return {s["device"] for s in self.suspects if s["named"]}


def slow(ratios: dict[str, float], min_ratio: float) -> bool:
    return any(r < min_ratio for r in ratios.values())


def ratios_to(figures: dict, medians: dict) -> dict[str, float]:
    """{matmul, memory}: a device's figures over the medians."""
    return {name: figures[key] / medians[key] for name, key in METRICS.items()}


def references(devices: list[dict], suspects: set[int]) -> dict[int, int]:
    """Per process, the device the rounds measure beside its suspects: its median device among those not
    suspected (none for a process whose every device is suspected)."""
    chosen = {}
    for process in sorted({d["process"] for d in devices}):
        healthy = [d for d in devices if d["process"] == process and d["device"] not in suspects]
        if healthy:
            middle = statistics.median_low(d["matmul_flops"] for d in healthy)
            chosen[process] = min(d["device"] for d in healthy if d["matmul_flops"] == middle)
    return chosen


def recheck(
    devices: list[dict],
    suspects: set[int],
    rate_once: Callable[[int], dict] | None,
    peers: Peers,
    min_ratio: float,
    medians: dict,
) -> Recheck:
    """Measure `suspects` (device ids among the fleet's first-look figures `devices`, judged against `medians`)
    again in rounds; rate_once(device id) times one call of each kind on a device of this process and returns
    its matmul_flops and memory_bytes_s (None on a process with no device). Every process calls this with the
    same arguments but its own rate_once, and returns the same Recheck."""
    refs = references(devices, suspects)
    measured = suspects | set(refs.values())
    mine = [d["device"] for d in devices if d["process"] == peers.index and d["device"] in measured]
    rounds: list[dict[int, dict]] = []  # per round: device id -> its figures
    outcome = verdict(devices, suspects, rounds, min_ratio, medians)
    while len(rounds) < ROUNDS and not decided(outcome):
        time.sleep(ROUND_GAP_S)
        peers.barrier(f"pre-flight round {len(rounds) + 1}")
        figures = {str(d): rate_once(d) for d in mine}  # JSON's keys are strings
        merged = peers.reduce(
            f"pre-flight round {len(rounds) + 1} figures",
            figures,
            lambda values: {k: v for value in values for k, v in value.items()},
        )
        rounds.append({int(k): v for k, v in merged.items()})
        outcome = verdict(devices, suspects, rounds, min_ratio, medians)
    return outcome


def decided(outcome: Recheck) -> bool:
    """Whether every suspect is slow in most of ROUNDS already, or normal in too many rounds to be."""
    majority = ROUNDS // 2 + 1
    return bool(outcome.rounds) and all(
        s["named"] or outcome.rounds - len(s["slow_rounds"]) > ROUNDS - majority for s in outcome.suspects
    )


def verdict(
    devices: list[dict], suspects: set[int], rounds: list[dict[int, dict]], min_ratio: float, medians: dict
) -> Recheck:
    """The suspects' ratios in the first look (against `medians`) and in each round (against the round's
    references), who is named (slow in most of ROUNDS), and the hosts loaded during the check."""
    refs = set(references(devices, suspects).values())
    history = [{d["device"]: ratios_to(d, medians) for d in devices}]
    history += [round_ratios(figures, refs) for figures in rounds]
    records = []
    for device in sorted(suspects):
        ratios = [h[device] for h in history]
        slow_rounds = [i for i, r in enumerate(ratios) if i and slow(r, min_ratio)]
        first = next(d for d in devices if d["device"] == device)
        records.append(
            {key: first[key] for key in ("host", "process", "device")}
            | {
                "ratios": {name: [round(r[name], 3) for r in ratios] for name in METRICS},
                "slow_rounds": slow_rounds,
                "rounds": len(rounds),
                "named": len(slow_rounds) >= ROUNDS // 2 + 1,
            }
        )
    return Recheck(records, loaded_hosts(devices, records, history, min_ratio), len(rounds))


def round_ratios(figures: dict[int, dict], refs: set[int]) -> dict[int, dict[str, float]]:
    """Each device's ratios to the median of the round's references (of every device, if no reference came)."""
    base = [f for d, f in figures.items() if d in refs] or list(figures.values())
    medians = {key: statistics.median(f[key] for f in base) for key in METRICS.values()}
    return {d: ratios_to(f, medians) for d, f in figures.items()}


def loaded_hosts(
    devices: list[dict], records: list[dict], history: list[dict[int, dict]], min_ratio: float
) -> list[dict]:
    """Hosts with a suspect but none named, every measured device of which was slow in some round (0: the first
    look): busy during the check, not slow hardware."""
    named_hosts = {r["host"] for r in records if r["named"]}
    loaded = []
    for host in sorted({r["host"] for r in records} - named_hosts):
        on_host = [d for d in devices if d["host"] == host]
        ids = {d["device"] for d in on_host}
        busy = [
            i
            for i, ratios in enumerate(history)
            if ids & ratios.keys() and all(slow(ratios[d], min_ratio) for d in ids & ratios.keys())
        ]
        if busy:
            loaded.append(
                {
                    "host": host,
                    "processes": sorted({d["process"] for d in on_host}),
                    "devices": sorted(ids),
                    "loaded_rounds": busy,
                    "rounds": len(history) - 1,
                }
            )
    return loaded
