"""Which values a function computes from its data, and which from its weights alone: read from its jaxpr.

The 1F1B schedule (one_f_one_b.py) runs a stage's forward pass for one micro-batch and its backward pass
iterations later, in between keeping the VJP's residuals. Some residuals are computed from the weights alone
(a weight cast to the compute dtype, transposed, or the weight itself): kept per micro-batch in flight they
would cost a copy of the stage's weights each, so the backward pass computes them again (cheap: no
activations are involved). `data_dependent` tells them apart by following every value of the jaxpr back to
the inputs it was computed from, through scans (to a fixed point over the carry), conditionals, whiles and
calls (pjit, remat, custom derivatives, shard_maps). Anything it cannot see into counts as depending on
all its inputs: at worst a weight-only residual is kept per micro-batch, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal


def data_dependent(fn: Callable, known: Sequence, data: Sequence) -> list[bool]:
    """For each output leaf of fn(*known, *data): whether it depends on any leaf of `data` (arrays or
    ShapeDtypeStructs; `known` are the inputs that stay the same from call to call, e.g. the weights)."""
    closed = jax.make_jaxpr(fn)(*known, *data)
    flags = [False] * len(jax.tree.leaves(known)) + [True] * len(jax.tree.leaves(data))
    return _outputs(closed.jaxpr, flags)


def _outputs(jaxpr: Jaxpr, inputs: list[bool]) -> list[bool]:
    depends = dict(zip(jaxpr.invars, inputs))

    def read(v) -> bool:
        return not isinstance(v, Literal) and depends.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _equation(eqn, ins) if any(ins) else [False] * len(eqn.outvars)
        depends.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _inner(jaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def _equation(eqn, ins: list[bool]) -> list[bool]:
    name, params, everything = eqn.primitive.name, eqn.params, [True] * len(eqn.outvars)
    if name == "scan" and (counts := _scan_counts(params, len(ins))):
        body, (consts, carry) = _inner(params["jaxpr"]), counts
        state = ins[consts : consts + carry]
        while True:  # the carry depends on the data once any iteration makes it so
            outs = _outputs(body, ins[:consts] + state + ins[consts + carry :])
            grown = [a or b for a, b in zip(state, outs[:carry])]
            if grown == state:
                return state + outs[carry:]
            state = grown
    if name == "cond":
        if ins[0]:  # the branch taken depends on the data
            return everything
        branches = [_outputs(_inner(b), ins[1:]) for b in params["branches"]]
        return [any(column) for column in zip(*branches)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):  # calls: the inner jaxpr's inputs are the equation's
        inner = params.get(key)
        if (
            isinstance(inner, (Jaxpr, ClosedJaxpr))
            and len(_inner(inner).invars) == len(ins)
            and len(_inner(inner).outvars) == len(eqn.outvars)
        ):
            return _outputs(_inner(inner), ins)
    return everything  # while loops and anything else: every output depends on every input


def _scan_counts(params: dict, inputs: int) -> tuple[int, int] | None:
    """(consts, carry) of a scan: jax <= 0.11 names the counts; newer ones give the (consts, carry, xs) structure."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    structure = params.get("ft_in")
    if structure is not None and len(structure) == 3 and sum(len(part) for part in structure) == inputs:
        return len(structure[0]), len(structure[1])
    return None  # unknown: every output depends on every input
