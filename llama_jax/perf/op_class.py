"""What each op of a traced step is: its class (a matmul by operand type, attention, a collective, a fusion, a
copy, other) and where in the model it comes from, read from the compiled step's HLO or, without it, from the op's
name; profile.py sums a trace's time by these.

The HLO is the step's optimized module that the profiler saves beside the trace (step.hlo.txt): the trace names
instructions of that module. A matmul is a dot or convolution, a cuBLAS(Lt) GEMM call, or a fusion holding one,
apart by its operands' type (fp8 = f8e4m3fn / f8e5m2, bf16, fp32); attention is a cuDNN fused-attention call, or an
op of the attention module's own computation (its name stack under `/attn/`, the q/k/v/o projections left to the
matmuls); a collective is an all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute (their
-start/-done halves too); copy/transpose is a copy or transpose, or a fusion of nothing but data movement; the other
fusions are `fusion`; the rest `other`. Without the HLO file the names alone decide, less surely (class_by_name).
"""

from __future__ import annotations

import re

from llama_jax.perf.hlo_text import computations as parsed_computations

CLASSES = (
    "matmul fp8",
    "matmul bf16",
    "matmul fp16",
    "matmul fp32",
    "matmul",
    "attention",
    "collective",
    "fusion",
    "copy/transpose",
    "other",
)
COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cublas$lt$matmul$mx")
# Instructions that only move or relabel data: a fusion of these (and its parameters) is a copy.
MOVES = {
    "parameter",
    "copy",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "constant",
    "tuple",
    "get-tuple-element",
    "copy-start",
    "copy-done",
    "bitcast-convert",
}
_ATTENTION_CORE = re.compile(r"/attn/(?![qkvo]_proj/)")  # the attention module's name stack, not its projections


def op_classes(hlo_text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Every instruction name of an optimized HLO module -> its class (CLASSES), and -> where in the model it comes
    from (its name stack, shortened: `backward layers/mlp/up_proj/dot_general`)."""
    computations = parsed_computations(hlo_text)
    instructions = [(comp, instr) for comp in computations.values() for instr in comp.instrs]
    return (
        {instr.name: _classify(computations, comp, instr) for comp, instr in instructions},
        {instr.name: _source(instr) for _, instr in instructions},
    )


def _source(instr) -> str:
    found = re.search(r'op_name="([^"]*)"', instr.attrs.get("metadata", ""))
    if not found:
        return ""
    path = found.group(1).split(";")[0]
    backward = "transpose(" in path  # jax names the backward pass's ops transpose(jvp(...))
    # Scopes jax adds around our names (eval_jaxpr: a scanned body's, on jax 0.12) are dropped.
    wrappers = r"(jit|pjit|jvp|transpose|remat|checkpoint|shard_map|custom_jvp_call|custom_vjp_call)\(.*\)"
    kept = [
        p
        for p in path.split("/")
        if not re.fullmatch(
            wrappers + r"|while|body|cond|closed_call|checkpoint|rematted_computation|branch_\d+_fun|eval_jaxpr", p
        )
    ]
    return " ".join(filter(None, ["backward" if backward else "", "/".join(kept)]))


def _classify(computations: dict, comp, instr) -> str:
    base = instr.opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVE_OPS:
        return "collective"
    if instr.opcode in ("dot", "convolution"):
        return "attention" if _in_attention(instr) else _matmul_class(comp, instr)
    if instr.opcode == "custom-call":
        target = instr.attrs.get("custom_call_target", "").strip('"')
        if target.startswith("__cudnn$fmha"):
            return "attention"
        if target in GEMM_TARGETS:
            return "matmul fp8" if target.endswith("$f8") else _matmul_class(comp, instr)
        return "attention" if _in_attention(instr) else "other"
    if instr.opcode in ("fusion", "async-start", "async-update", "async-done"):
        return _classify_body(computations, instr)
    if instr.opcode in ("copy", "transpose", "copy-start", "copy-done"):
        return "copy/transpose"
    return "attention" if _in_attention(instr) else "other"


def _classify_body(computations: dict, instr) -> str:
    """A fusion (or async wrapper) is what its body does: its matmul, collective or attention call if it holds one,
    else a copy when it only moves data, attention by its name stack, else a fusion."""
    body = list(_body(computations, instr.attrs.get("calls", "")))
    inner = [
        _classify(computations, comp, i)
        for comp, i in body
        if i.opcode in ("dot", "convolution", "custom-call")
        or i.opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVE_OPS
    ]
    for wanted in ("collective", "matmul fp8", "matmul bf16", "matmul fp16", "matmul fp32", "matmul", "attention"):
        if wanted in inner:
            return wanted
    if instr.opcode == "fusion" and all(i.opcode in MOVES for _, i in body):
        return "copy/transpose"  # wherever it is: the time data movement takes
    if _in_attention(instr):
        return "attention"
    return "fusion" if instr.opcode == "fusion" else "other"


def _body(computations: dict, calls: str):
    """(computation, instruction) of the called computations, nested fusions and calls included."""
    for name in calls.strip("{}").split(","):  # `calls=%f` or, for several, `calls={%a, %b}`
        comp = computations.get(name.strip().lstrip("%"))
        if comp is None:
            continue
        for instr in comp.instrs:
            yield comp, instr
            if "calls" in instr.attrs:
                yield from _body(computations, instr.attrs["calls"])


def _matmul_class(comp, instr) -> str:
    dtypes = [_dtype(comp, operand) for operand in instr.operands[:2]]
    if any(d.startswith("f8") for d in dtypes):
        return "matmul fp8"
    named = {"bf16": "matmul bf16", "f16": "matmul fp16", "f32": "matmul fp32"}
    return named.get(dtypes[0] if dtypes else "", "matmul")


def _dtype(comp, operand: str) -> str:
    parts = operand.split()  # some XLA versions print "f32[2,3]{1,0} %x" for an operand
    shape = parts[0] if len(parts) > 1 else comp.shapes.get(operand.lstrip("%"), "")
    return shape.split("[", 1)[0].strip("(")


def _in_attention(instr) -> bool:
    found = re.search(r'op_name="([^"]*)"', instr.attrs.get("metadata", ""))
    return bool(found and _ATTENTION_CORE.search(found.group(1)))


def class_by_name(op: str) -> str:
    """An op's class from its name alone (no HLO file): XLA names instructions after their opcode."""
    name = op.lower()
    if any(c in name for c in COLLECTIVE_OPS):
        return "collective"
    if "fmha" in name:
        return "attention"
    if any(m in name for m in ("dot", "convolution", "gemm", "cublas", "matmul")):
        return "matmul"
    if name.startswith(("copy", "transpose")):
        return "copy/transpose"
    return "fusion" if "fusion" in name else "other"
