"""Per-step FLOPs and collective traffic from a compiled XLA HLO module's text.

Input is `jax.jit(f).lower(...).compile().as_text()` (the post-SPMD, per-device program).
XLA's `compiled.cost_analysis()` counts a while-loop (scan) body once; here every computation
is weighted by how many times it runs per step, so a scanned layer stack counts every layer.

Multiplicity of a computation: ENTRY = 1; while body/condition = caller x trip count (loops.py: XLA's
known_trip_count, or the condition's bound; a while without either counts once and is reported in
`unknown_trip_counts`);
fusion/call/custom-call/async/reducer callees = caller. Every branch of a conditional gets the
caller's multiplicity, so programs with conditionals give an upper bound, unless the caller says how
often a conditional named under a jax.named_scope runs each branch (`branch_runs`: the 1F1B
pipeline's forward, loss and backward passes, one_f_one_b.py; cuDNN attention's kernel choice, cudnn.py). A
computation called from several places sums the multiplicities. An operation whose work depends on run-time
lengths its shape cannot show (a padded kernel that skips the padding) counts the share of its shape's work the
caller gives for its scope (`work_shares`: context parallelism's prefix, context_parallel.py).

FLOPs: each instruction's (op_cost.py: dots, convolutions, GPU library matmuls and cuDNN fused attention,
wherever they sit) times its computation's multiplicity.

Collective traffic, per device, ring cost model with group size n (n = 1 moves nothing):
  all-gather          (n-1)/n  x result bytes
  reduce-scatter      (n-1)    x result bytes   (= (n-1)/n x operand bytes)
  all-reduce          2(n-1)/n x result bytes   (reduce-scatter + all-gather)
  all-to-all          (n-1)/n  x result bytes
  collective-permute  1        x result bytes   (each device sends its buffer once)
Async pairs are counted at the `-start` only. Each collective's device groups are kept with its bytes
(`HloStats.collective_groups`), so that costmodel.py can tell which mesh axes, and links, it crosses.

Operations, for a roofline: every instruction of a scheduled computation (the entry, loop bodies
and conditions, conditional branches, called computations; not fusion bodies or reducers) with its
FLOPs (a fusion's: its body's), the bytes it reads and writes and which of its FLOPs are fp8 matmuls'
(op_cost.py), times its multiplicity. Data movement without arithmetic (parameter, tuple, bitcast, ...) and
control flow are left out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from llama_jax.perf import loops, op_cost
from llama_jax.perf.hlo_text import (
    Computation,
    DeviceGroups,
    Instr,
    device_groups,
    parse_module,
    shape_bytes,
    split_top,
)

# How often conditionals named under a jax.named_scope run each branch (analyze's branch_runs).
BranchRuns = dict[str, float | tuple[float, ...]]
# The share of its shape's work an operation named under a jax.named_scope does (analyze's work_shares).
WorkShares = dict[str, float]
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Bytes each device sends per result byte, for a group of n (module docstring).
_RING = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1.0,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
}
# Attributes naming called computations; `body`/`condition` additionally scale by the trip count.
_CALL_ATTRS = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "true_computation",
    "false_computation",
    "branch_computations",
    "called_computations",
)
# Instructions that move no data through memory themselves (views, bookkeeping, control flow).
_FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "domain",
}


@dataclass(frozen=True)
class CollectiveStats:
    count: int  # executions per step (instruction count x how many times its computation runs)
    buffer_bytes: int  # sum of result sizes per device (per execution x executions)
    moved_bytes: float  # per-device bytes sent over links, ring cost model (module docstring)


@dataclass(frozen=True)
class HloStats:
    dot_flops: float  # per step, per device: dots, convolutions, GPU library matmuls
    collectives: dict[str, CollectiveStats]  # all five KINDS, zeros if absent
    unknown_trip_counts: int  # while loops without known_trip_count (counted once)
    # Per scheduled operation (flops, bytes read + written, the flops of fp8 matmuls among them), each already times
    # its executions per step.
    operations: tuple[tuple[float, float, float], ...] = ()
    # Per-device bytes sent per step by (kind, device groups): which devices exchange them, for costmodel.py
    # to tell which mesh axes and links they cross. The bytes of one kind sum to its moved_bytes.
    collective_groups: dict[tuple[str, DeviceGroups], float] = field(default_factory=dict)
    # Per-device bytes sent per step by the collectives named under each of analyze's `scopes` (the innermost).
    scope_collective_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def memory_bytes(self) -> float:
        """Bytes read and written by the operations per step, per device."""
        return sum(op[1] for op in self.operations)

    @property
    def fp8_flops(self) -> float:
        """Per step, per device: the FLOPs of matmuls whose operands are fp8 (part of dot_flops)."""
        return sum(op[2] for op in self.operations)


def roofline_seconds(operations, flops_per_s: float, bytes_per_s: float, fp8_flops_per_s: float | None = None) -> float:
    """Each operation takes as long as its arithmetic or its memory traffic, whichever is longer; its fp8 matmuls'
    FLOPs at fp8_flops_per_s (None: no faster fp8 rate, e.g. on a CPU) and the rest at flops_per_s. An operation
    is (flops, bytes) or (flops, bytes, fp8 flops)."""
    fp8_rate = fp8_flops_per_s or flops_per_s
    return sum(
        max((f - fp8) / flops_per_s + fp8 / fp8_rate, b / bytes_per_s) for f, b, fp8 in map(_with_fp8, operations)
    )


def _with_fp8(operation) -> tuple[float, float, float]:
    return (*operation, 0.0) if len(operation) == 2 else tuple(operation)


def _callees(instr: Instr, trip_count: int) -> Iterator[tuple[str, int]]:
    if instr.opcode.endswith("-done") or instr.opcode == "async-update":
        return  # these repeat the `calls=` of their async-start; counting both would double it
    for attr in _CALL_ATTRS:
        for callee in split_top(instr.attrs.get(attr, "").strip("{}")):
            yield callee.lstrip("%"), trip_count if attr in ("body", "condition") else 1


def analyze(
    hlo_text: str,
    num_devices: int,
    branch_runs: BranchRuns | None = None,
    work_shares: WorkShares | None = None,
    scopes: tuple[str, ...] = (),
) -> HloStats:
    """Per-step, per-device dot FLOPs and collective traffic of a compiled HLO module. `branch_runs`: for a
    conditional named under jax.named_scope(scope), how often it takes each branch (_branch_weights);
    `work_shares`: for other operations named under a scope, the share of their FLOPs and bytes that runs;
    `scopes`: named scopes whose collectives' bytes are also given apart (scope_collective_bytes)."""
    comps, entry = parse_module(hlo_text)
    callers, unknown = _callers(comps, branch_runs or {})
    multiplicity = _multiplicities(comps, entry, callers)
    flops, operations = _work(comps, multiplicity, _scheduled_names(comps, entry), work_shares or {})
    collectives, by_groups, by_scope = _collectives(comps, multiplicity, num_devices, scopes)
    return HloStats(
        dot_flops=flops,
        collectives=collectives,
        unknown_trip_counts=unknown,
        operations=tuple(operations),
        collective_groups=by_groups,
        scope_collective_bytes=by_scope,
    )


def _callers(comps: dict[str, Computation], branch_runs: BranchRuns) -> tuple[dict[str, list[tuple[str, float]]], int]:
    """Each computation's callers, with how many times a run of the caller runs it; and how many while loops
    have no known trip count (each counted once)."""
    callers: dict[str, list[tuple[str, float]]] = defaultdict(list)
    unknown = 0
    for comp in comps.values():
        for instr in comp.instrs:
            trips = loops.trip_count(instr, comp, comps) if instr.opcode == "while" else 1
            if trips is None:
                unknown, trips = unknown + 1, 1
            weights = _branch_weights(instr, branch_runs)
            for callee, factor in _callees(instr, trips):
                callers[callee].append((comp.name, factor * weights.get(callee, 1.0)))
    return callers, unknown


def _multiplicities(
    comps: dict[str, Computation], entry: str, callers: dict[str, list[tuple[str, float]]]
) -> dict[str, float]:
    """How many times each computation runs per step (module docstring)."""
    multiplicity: dict[str, float] = {}

    def runs(name: str) -> float:  # call graphs are DAGs, so this terminates; unreachable -> 0
        if name not in multiplicity:
            multiplicity[name] = 1 if name == entry else sum(runs(c) * f for c, f in callers[name])
        return multiplicity[name]

    for name in comps:
        runs(name)
    return multiplicity


def _scheduled_names(comps: dict[str, Computation], entry: str) -> set[str]:
    # Computations that run as a sequence of operations (not fused into one kernel or applied per element).
    return {entry} | {
        callee.lstrip("%")
        for comp in comps.values()
        for instr in comp.instrs
        if instr.opcode != "fusion"
        for attr in ("body", "condition", "true_computation", "false_computation", "branch_computations")
        + (("to_apply",) if instr.opcode == "call" else ())
        for callee in split_top(instr.attrs.get(attr, "").strip("{}"))
    }


def _work(
    comps: dict[str, Computation], multiplicity: dict[str, float], scheduled_names: set[str], work_shares: WorkShares
) -> tuple[float, list[tuple[float, float, float]]]:
    """Per step: the FLOPs of every instruction, and (flops, bytes read + written, fp8 flops) of each scheduled
    operation (module docstring)."""
    flops = 0.0
    operations = []
    for comp in comps.values():
        if (mult := multiplicity[comp.name]) == 0:
            continue
        scheduled = comp.name in scheduled_names
        for instr in comp.instrs:
            share = _work_share(instr, work_shares)
            flops += mult * share * op_cost.flops(comp, instr)
            if scheduled and instr.opcode not in _FREE and not instr.opcode.endswith("-done"):
                own, fp8 = (
                    op_cost.flops(comp, instr, fp8_only)
                    + (
                        op_cost.body_flops(comps, instr.attrs["calls"].lstrip("%"), fp8_only)
                        if instr.opcode == "fusion"
                        else 0.0
                    )
                    for fp8_only in (False, True)
                )
                traffic = op_cost.traffic(comps, comp, instr)
                operations.append((mult * share * own, mult * share * traffic, mult * share * fp8))
    return flops, operations


def _collectives(
    comps: dict[str, Computation], multiplicity: dict[str, float], num_devices: int, scopes: tuple[str, ...] = ()
) -> tuple[dict[str, CollectiveStats], dict[tuple[str, DeviceGroups], float], dict[str, float]]:
    """Per step: each KIND's executions and bytes, the bytes sent by (kind, device groups) (module docstring), and
    the bytes sent under each of `scopes`."""
    count, buffer, moved = defaultdict(float), defaultdict(float), defaultdict(float)
    by_scope = dict.fromkeys(scopes, 0.0)
    by_groups: dict[tuple[str, DeviceGroups], float] = defaultdict(float)
    parsed: dict[tuple, DeviceGroups] = {}  # a program repeats a few replica-group lists many times
    for comp in comps.values():
        if (mult := multiplicity[comp.name]) == 0:
            continue
        for instr in comp.instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            nbytes = shape_bytes(op_cost.output_shape(instr))
            key = tuple(instr.attrs.get(a) for a in ("replica_groups", "device_ids", "source_target_pairs"))
            if key not in parsed:
                parsed[key] = device_groups(instr.attrs, num_devices)
            groups = parsed[key]
            sent = mult * nbytes * (1.0 if kind == "collective-permute" else _RING[kind](len(groups[0])))
            count[kind] += mult
            buffer[kind] += mult * nbytes
            moved[kind] += sent
            by_groups[kind, groups] += sent
            if scopes and (scope := _innermost_scope(instr, scopes)):
                by_scope[scope] += sent
    collectives = {k: CollectiveStats(round(count[k]), round(buffer[k]), moved[k]) for k in KINDS}
    return collectives, dict(by_groups), by_scope


def permute_loop_trips(hlo_text: str, num_devices: int, wanted: Callable[[DeviceGroups], bool]) -> list[int]:
    """Trip counts of the while loops whose body hands data on with a collective permute between the
    (source, target) pairs that `wanted` accepts: e.g. the iterations of a pipeline schedule (pipeline.py;
    its forward and backward loops, permuting along the pipeline axis), as compiled (loops.py: unrolled loops
    count the iterations they stand for)."""
    comps, _ = parse_module(hlo_text)
    trips = []
    for comp in comps.values():
        for instr in comp.instrs:
            body = comps.get(instr.attrs.get("body", "").lstrip("%")) if instr.opcode == "while" else None
            hands_on = (
                [
                    i
                    for i in body.instrs
                    if i.opcode.removesuffix("-start") == "collective-permute"
                    and wanted(device_groups(i.attrs, num_devices))
                ]
                if body
                else []
            )
            if hands_on:
                trips.append(
                    loops.permute_iterations(instr, comp, body, loops.trip_count(instr, comp, comps) or 1, hands_on[0])
                )
    return trips


def _branch_weights(instr: Instr, branch_runs: BranchRuns) -> dict[str, float]:
    """A conditional named under one of branch_runs' scopes (the innermost, if nested): its branches' shares of
    its runs. A float is a two-way conditional's true share (jax's lax.cond: branch 0 false, 1 true); a tuple
    gives the shares of the first branches in order (lax.switch), and the branches after them never run."""
    if instr.opcode != "conditional" or not branch_runs:
        return {}
    scope = _innermost_scope(instr, branch_runs)
    branches = [b.strip().lstrip("%") for b in split_top(instr.attrs.get("branch_computations", "").strip("{}"))]
    if scope is None:
        return {}
    share = branch_runs[scope]
    if isinstance(share, tuple):
        return {branch: share[i] if i < len(share) else 0.0 for i, branch in enumerate(branches)}
    return {branches[0]: 1 - share, branches[1]: share} if len(branches) == 2 else {}


def _work_share(instr: Instr, work_shares: WorkShares) -> float:
    """The share of its work an operation named under one of work_shares' scopes does (the innermost); else 1."""
    if not work_shares or instr.opcode == "conditional":
        return 1.0
    scope = _innermost_scope(instr, work_shares)
    return 1.0 if scope is None else work_shares[scope]


def _innermost_scope(instr: Instr, scopes: Iterable[str]) -> str | None:
    """The innermost of `scopes` the instruction's op name is under, if any. A scope is a step of the op name's
    path, bare or inside a transformation's name: .../jvp(scope)/cond."""
    name = instr.attrs.get("metadata", "")
    found = [(m.start(), scope) for scope in scopes for m in re.finditer(rf"(?<=[/(]){re.escape(scope)}(?=[/)])", name)]
    return max(found)[1] if found else None


def named_buffer_bytes(hlo_text: str, scope: str) -> list[int]:
    """Per device, the bytes of each buffer written in place (dynamic-update-slice) by operations named under
    jax.named_scope(`scope`): e.g. the 1F1B schedule's residual slots (one_f_one_b.py), as compiled."""
    comps, _ = parse_module(hlo_text)
    return [
        shape_bytes(i.shape)
        for comp in comps.values()
        for i in comp.instrs
        if i.opcode == "dynamic-update-slice" and f"/{scope}/" in i.attrs.get("metadata", "")
    ]


def custom_calls(hlo_text: str) -> list[tuple[str, tuple[str, ...], str]]:
    """Every custom call of a module, fusion bodies included: (target, its operands' shapes, its result's shape).
    What a compiled program hands to libraries: e.g. which GEMMs XLA:GPU gave cuBLASLt's fp8 kernel."""
    comps, _ = parse_module(hlo_text)
    return [
        (
            i.attrs.get("custom_call_target", "").strip('"'),
            tuple(o.split()[0] if len(o.split()) > 1 else comp.shapes.get(o.lstrip("%"), "") for o in i.operands),
            i.shape,
        )
        for comp in comps.values()
        for i in comp.instrs
        if i.opcode == "custom-call"
    ]
