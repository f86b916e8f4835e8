"""What one instruction of a compiled HLO module costs, each time it runs: its FLOPs, which of them are fp8
matmuls', and the bytes it reads and writes. hlo.py weights these by how often each instruction runs per step.

FLOPs: `dot` = 2 x result elements x product of lhs contracting dims; `convolution` =
2 x result elements x product of kernel dims other than the output feature ('o') dim. GPU library
calls, wherever they sit: a cuBLAS(Lt) GEMM (`__cublas$gemm`, `__cublas$lt$matmul[$f8|$mx]`) like a
dot, from its `gemm_backend_config`; cuDNN fused attention (`__cudnn$fmha*`) by its matmuls over the
visible (query, key) pairs (fmha.py). A fusion's FLOPs are its body's (body_flops). The fp8 ones are those of a
dot or GEMM whose operands are f8* (model.fp8's projections; tensor cores run them at twice the bf16 rate).

Bytes: operands + result, less a library call's workspace; of an operand a fusion's body only slices, the
slices; of a buffer updated in place, the update (traffic).
"""

from __future__ import annotations

import math
from collections import defaultdict

from llama_jax.perf import fmha, loops
from llama_jax.perf.hlo_text import Computation, Instr, arrays, close_bracket, shape_bytes, split_top, strip_comments


def flops(comp: Computation, instr: Instr, fp8_only: bool = False) -> float:
    """An instruction's FLOPs; with fp8_only, only a matmul's whose operands are fp8 (others count 0)."""
    if fp8_only and not _fp8_matmul(comp, instr):
        return 0.0
    if instr.opcode == "custom-call":
        return _library_call_flops(comp, instr)
    if instr.opcode not in ("dot", "convolution"):
        return 0.0
    out = math.prod(arrays(instr.shape)[0][1])
    if instr.opcode == "dot":
        contracting = instr.attrs.get("lhs_contracting_dims", "{}").strip("{}")
        return _matmul_flops(comp, instr, [int(d) for d in contracting.split(",") if d.strip()])
    # convolution: dim_labels=b01f_01io->b01f, the kernel's labels are the 2nd group
    kernel_labels = instr.attrs["dim_labels"].split("->")[0].split("_")[1]
    kernel = _operand_dims(comp, instr.operands[1])
    return 2.0 * out * math.prod(d for d, label in zip(kernel, kernel_labels) if label != "o")


def body_flops(comps: dict[str, Computation], name: str, fp8_only: bool = False) -> float:
    """FLOPs inside a fusion body (dots, library calls), nested fusions included; fp8_only: of fp8 matmuls only."""
    comp = comps[name]
    return sum(
        flops(comp, i, fp8_only)
        + (body_flops(comps, i.attrs["calls"].lstrip("%"), fp8_only) if i.opcode == "fusion" else 0.0)
        for i in comp.instrs
    )


def _fp8_matmul(comp: Computation, instr: Instr) -> bool:
    """A dot or cuBLAS(Lt) GEMM whose two matrix operands are fp8 (f8e4m3fn, f8e5m2, ...): tensor cores run it at
    the fp8 rate. cuBLASLt's fp8 GEMM takes its scales as further operands."""
    if instr.opcode == "dot" or (
        instr.opcode == "custom-call" and instr.attrs.get("custom_call_target", "").strip('"') in _GEMM_TARGETS
    ):
        return len(instr.operands) >= 2 and all(_operand_dtype(comp, o).startswith("f8") for o in instr.operands[:2])
    return False


def _operand_dtype(comp: Computation, operand: str) -> str:
    parts = operand.split()  # some XLA versions print "f32[2,3]{1,0} %x" for operands
    shape = parts[0] if len(parts) > 1 else comp.shapes.get(operand.lstrip("%"), "")
    return arrays(shape)[0][0] if shape else ""


# GPU library calls: XLA:GPU rewrites most dots to cuBLAS(Lt) custom calls and jax's cuDNN attention is one.
_GEMM_TARGETS = {"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cublas$lt$matmul$mx"}


def _matmul_flops(comp: Computation, instr: Instr, lhs_contracting: list[int]) -> float:
    """2 x output elements x contracted size. A library call's output is the first element of its result
    tuple (then an fp8 amax, then the workspace)."""
    lhs = _operand_dims(comp, instr.operands[0])
    return 2.0 * math.prod(arrays(instr.shape)[0][1]) * math.prod(lhs[d] for d in lhs_contracting)


def _library_call_flops(comp: Computation, instr: Instr) -> float:
    target = instr.attrs.get("custom_call_target", "").strip('"')
    try:
        if target in _GEMM_TARGETS:
            numbers = loops.backend_config(instr)["gemm_backend_config"]["dot_dimension_numbers"]
            return _matmul_flops(comp, instr, fmha.dimensions(numbers, "lhs_contracting_dimensions"))
        if target.startswith("__cudnn$fmha"):
            return fmha.attention_flops(
                loops.backend_config(instr)["cudnn_fmha_backend_config"],
                *(_operand_dims(comp, o) for o in instr.operands[:3]),
                backward="Backward" in target,
            )
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        # A config this XLA version writes differently counts as no FLOPs rather than failing `plan` and every
        # `tune` candidate: plan's HLO/model FLOP ratio then shows what is missing.
        return 0.0
    return 0.0


def _operand_dims(comp: Computation, operand: str) -> list[int]:
    parts = operand.split()  # some XLA versions print "f32[2,3]{1,0} %x" for operands
    shape = parts[0] if len(parts) > 1 else comp.shapes[operand.lstrip("%")]
    return arrays(shape)[0][1]


# Operations that read a window of their first operand (a layer's slice of stacked weights or saved activations):
# they move the window's bytes, not the whole operand's.
_WINDOW_READS = {"dynamic-slice", "slice", "gather"}


def traffic(comps: dict[str, Computation], comp: Computation, instr: Instr) -> float:
    """Bytes an operation reads and writes. A window read moves the window; a dynamic-update-slice writes its
    update into a buffer in place (XLA aliases the two), reading and writing the update only; a fusion (or an
    async fusion-start) reads each operand whole unless its body only takes windows of it or updates it in place,
    and writes its root's outputs, of an in-place update the update only. Without this, a scanned layer stack's
    slot of stacked activations counted the whole stack once per layer (the number of layers times over)."""
    body = comps.get(instr.attrs.get("calls", "").lstrip("%")) if instr.opcode in ("fusion", "fusion-start") else None
    if body is not None and body.instrs:
        users = _users(body)
        params = {int(i.operands[0]): i for i in body.instrs if i.opcode == "parameter"}
        read = sum(
            _read_bytes(users, params[n].name, _operand_bytes(comp, operand)) if n in params else 0
            for n, operand in enumerate(instr.operands)
        )
        return read + _written_bytes(body, body.instrs[-1])
    if instr.opcode == "dynamic-update-slice":
        return 2 * _operand_bytes(comp, instr.operands[1])
    if instr.opcode in _WINDOW_READS:
        return 2 * shape_bytes(instr.shape)
    result = shape_bytes(output_shape(instr)) if instr.opcode.endswith("-start") else _result_bytes(instr)
    return result + sum(_operand_bytes(comp, o) for o in instr.operands)


def output_shape(instr: Instr) -> str:
    # all-gather-start / collective-permute-start return (operand, output[, contexts...]);
    # all-reduce-start returns just its output(s).
    shape = strip_comments(instr.shape).strip()
    elements = split_top(shape[1 : close_bracket(shape, 0)]) if shape.startswith("(") else [shape]
    if instr.opcode.endswith("-start") and instr.opcode != "all-reduce-start" and len(elements) > 1:
        return elements[1]
    return instr.shape


def _result_bytes(instr: Instr) -> int:
    """Bytes an operation writes. cuBLAS and cuDNN calls end their result tuple with a workspace, s8[n] or
    u8[n]: scratch space the library may use, not data it must write."""
    leaves = split_top(strip_comments(instr.shape).strip()[1:-1]) if instr.shape.startswith("(") else []
    target = instr.attrs.get("custom_call_target", "").strip('"')
    if len(leaves) > 1 and target.startswith(("__cublas$", "__cudnn$")) and leaves[-1][:3] in ("s8[", "u8["):
        return sum(shape_bytes(leaf) for leaf in leaves[:-1])
    return shape_bytes(instr.shape)


def _operand_bytes(comp: Computation, operand: str) -> int:
    parts = operand.split()  # some XLA versions print "f32[2,3]{1,0} %x" for operands
    if len(parts) > 1:
        return shape_bytes(parts[0])
    shape = comp.shapes.get(operand.lstrip("%"))
    return shape_bytes(shape) if shape else 0  # a literal operand, e.g. in a constant


def _users(body: Computation) -> dict[str, list[tuple[Instr, int]]]:
    users: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
    for i in body.instrs:
        for position, operand in enumerate(i.operands):
            users[operand.split()[-1].lstrip("%")].append((i, position))
    return users


def _read_bytes(users: dict[str, list[tuple[Instr, int]]], name: str, whole: float) -> float:
    """What a fused computation reads of its value `name` (`whole` bytes): windows of it, nothing of a buffer it
    updates in place, or all of it."""
    total = 0.0
    for user, position in users.get(name, []):
        if user.opcode == "bitcast":
            total += _read_bytes(users, user.name, whole)
        elif position == 0 and user.opcode in _WINDOW_READS:
            total += shape_bytes(user.shape)
        elif position != 0 or user.opcode != "dynamic-update-slice":
            return whole
    return min(total, whole)


def _written_bytes(body: Computation, root: Instr) -> float:
    """What a fused computation writes: each output, of an in-place update only the update."""
    if root.opcode == "tuple":
        by_name = {i.name: i for i in body.instrs}
        return sum(_written_bytes(body, by_name[o.split()[-1].lstrip("%")]) for o in root.operands)
    if root.opcode == "dynamic-update-slice":
        return _operand_bytes(body, root.operands[1])
    return shape_bytes(root.shape)
