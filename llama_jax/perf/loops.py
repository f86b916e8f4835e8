"""How often a compiled while loop runs, as XLA leaves it (hlo.py's multiplicities; a pipeline's iterations).

XLA records a loop's count in its backend_config (`known_trip_count`). XLA:GPU's loop transformations change
loops in two ways that matter here:
- double buffering (launch/gpu_env.sh turns it on) unrolls a loop by 2: each trip runs two iterations of the
  source loop (`known_init_step.step`), and an odd count's last iteration is peeled into the calling
  computation;
- the collective pipeliner moves one iteration's collectives out of the loop and peels that iteration; the loop
  it leaves may carry no known_trip_count, but still counts its induction variable from a constant up to a
  constant bound, which trip_count() reads from its condition.
The functions take hlo_text.py's parsed instructions and computations (objects with name, opcode, operands, attrs
and instrs), so this module needs nothing of hlo_text.py's.
"""

from __future__ import annotations

import json
import math

_FOLLOWED = ("copy", "bitcast", "convert")  # ops that carry a scalar through unchanged
# The iterations `compare(i, bound)` lets through, for i counting up from `start` by `step`.
_RUNS = {
    "LT": lambda start, bound, step: math.ceil((bound - start) / step),
    "LE": lambda start, bound, step: math.floor((bound - start) / step) + 1,
    "NE": lambda start, bound, step: math.ceil((bound - start) / step),
}


def backend_config(instr) -> dict:
    try:
        config = json.loads(instr.attrs.get("backend_config", "{}"))
        return json.loads(config) if isinstance(config, str) else config  # older XLA quotes the JSON
    except ValueError:
        return {}


def unrolled(instr) -> int:
    """Iterations of the source loop that one trip of this while loop runs (2 when double-buffered)."""
    try:
        return max(1, int(backend_config(instr)["known_init_step"]["step"]))
    except (KeyError, TypeError, ValueError):
        return 1


def trip_count(instr, caller, comps: dict) -> int | None:
    """Trips of a while loop: its known_trip_count, else its condition's bound on an induction variable that
    starts at a constant (None when neither can be read)."""
    config = backend_config(instr)
    try:
        return int(config["known_trip_count"]["n"])
    except (KeyError, TypeError, ValueError):
        pass
    try:
        index = int(config["known_induction_variable"]["tuple_index"])
        start = _constant(caller, _tuple_operand(caller, instr.operands[0], index))
        direction, bound = _bound(comps, instr.attrs["condition"].lstrip("%"))
        runs = _RUNS[direction](start, bound, unrolled(instr))
    except (KeyError, IndexError, TypeError, ValueError, StopIteration):
        return None
    return max(runs, 0)


def _named(comp, name: str):
    return next(i for i in comp.instrs if i.name == name.split()[-1].lstrip("%"))


def _tuple_operand(comp, operand: str, index: int) -> str:
    return _named(comp, operand).operands[index] if _named(comp, operand).opcode == "tuple" else ""


def _constant(comp, operand: str) -> int:
    instr = _named(comp, operand)
    while instr.opcode in _FOLLOWED:
        instr = _named(comp, instr.operands[0])
    if instr.opcode != "constant":
        raise ValueError(f"{instr.name} is not a constant")
    return int(instr.operands[0])


def _bound(comps: dict, condition: str) -> tuple[str, int]:
    """(direction, constant bound) of the comparison a loop condition ends in, inside a fusion if need be."""
    comp = comps[condition]
    root = comp.instrs[-1]
    if root.opcode == "fusion":
        comp = comps[root.attrs["calls"].lstrip("%")]
        root = comp.instrs[-1]
    if root.opcode != "compare":
        raise ValueError("the condition is not a comparison")
    return root.attrs["direction"], _constant(comp, root.operands[1])


def permute_iterations(instr, caller, body, trips: int, hands_on) -> int:
    """Iterations of a loop whose body hands data on with the collective permute `hands_on` (a pipeline's loop):
    its trips times the source iterations each runs, plus those peeled into the calling computation, each with
    its own permute of the same (source, target) pairs."""
    pairs = hands_on.attrs.get("source_target_pairs")

    def permutes(comp) -> int:
        return sum(
            i.opcode.removesuffix("-start") == "collective-permute" and i.attrs.get("source_target_pairs") == pairs
            for i in comp.instrs
        )

    step = unrolled(instr)
    return trips * step + (permutes(caller) * step // permutes(body) if step > 1 else 0)
