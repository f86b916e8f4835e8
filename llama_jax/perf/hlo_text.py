"""Compiled HLO text, read: its computations and their instructions (name, result shape, opcode, operands,
attributes), shapes and their bytes, and the device groups of a collective.

HLO nests (), [] and {} and quotes strings (a backend_config's JSON); one walk over the characters that skips
quoted text and tracks the bracket depth is the whole tokenizer, and everything else splits at depth 0.
Replica groups come in three notations (explicit {{0,1},{2,3}}, iota [groups,size]<=[dims]T(perm), and Shardy's
mesh['a'=4,'b'=2] {'a'}); device_groups reads each as positions in the program's device assignment.
hlo.py counts FLOPs, memory traffic and collective bytes from what this reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

# The devices of each group of a collective (positions in the program's device assignment).
DeviceGroups = tuple[tuple[int, ...], ...]

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
    "opaque": 0,
}


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: dict[str, str]


@dataclass
class Computation:
    name: str
    shapes: dict[str, str] = field(default_factory=dict)  # parameter/instruction name -> result shape
    instrs: list[Instr] = field(default_factory=list)


def _walk(text: str) -> Iterator[tuple[int, str, int]]:
    """Yield (index, char, depth outside the char) for every character not inside quotes.
    This is the whole tokenizer: HLO nests (), [], {} and strings; the rest splits at depth 0."""
    depth, quote, escaped = 0, "", False
    for i, ch in enumerate(text):
        if quote:  # backend_config="{\"a\":1}" style strings escape their quotes
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        else:
            if ch in ")]}":
                depth -= 1
            yield i, ch, depth
            if ch in "([{":
                depth += 1


def close_bracket(text: str, start: int) -> int:
    """Index of the bracket closing the one at text[start]."""
    for i, ch, depth in _walk(text[start:]):
        if ch in ")]}" and depth == 0:
            return start + i
    raise ValueError(f"unbalanced brackets in {text[:80]!r}")


def split_top(text: str) -> list[str]:
    """Split on commas that are outside brackets and quotes; drop empty pieces."""
    cuts = [i for i, ch, depth in _walk(text) if ch == "," and depth == 0]
    pieces = [text[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]
    return [p.strip() for p in pieces if p.strip()]


def strip_comments(text: str) -> str:
    """Drop `/*index=5*/` markers that XLA puts inside long tuples."""
    while "/*" in text:
        a = text.index("/*")
        text = text[:a] + text[text.index("*/", a) + 2 :]
    return text


def arrays(shape: str) -> list[tuple[str, list[int]]]:
    """Flatten a (possibly nested tuple) shape into (dtype, dims) leaves."""
    shape = strip_comments(shape).strip()
    if shape.startswith("("):
        return [leaf for part in split_top(shape[1 : close_bracket(shape, 0)]) for leaf in arrays(part)]
    dtype, _, rest = shape.partition("[")
    dims = rest[: rest.index("]")] if rest else ""
    # `<=N` marks a bounded dynamic dimension; N is the buffer size.
    return [(dtype.strip(), [int(d.strip().removeprefix("<=")) for d in dims.split(",") if d.strip()])]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, e.g. "f32[32,128]{1,0}" -> 16384 or "(f32[], bf16[2,3])" -> 16."""
    total = 0
    for dtype, dims in arrays(shape):
        # fp8 is one byte; sub-byte types (s4, f4e2m1fn, ...) are rounded up to one (upper bound).
        size = 1 if dtype[:2] in ("f8", "f4", "s4", "u4", "s2", "u2") else _DTYPE_BYTES.get(dtype)
        if size is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        total += size * math.prod(dims)
    return total


def parse_instr(line: str) -> Instr | None:
    """`[ROOT] %name = <shape> <opcode>(<operands>), key=value, ...` -> Instr."""
    name, eq, rest = line.strip().removeprefix("ROOT ").partition(" = ")
    if not eq:
        return None
    end = close_bracket(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")  # tuple shapes have spaces
    shape, rest = rest[:end], rest[end:].strip()
    paren = rest.index("(")
    close = close_bracket(rest, paren)
    attrs = {}
    for item in split_top(rest[close + 1 :]):
        key, _, value = item.partition("=")
        attrs[key.strip()] = value.strip()
    operands = split_top(strip_comments(rest[paren + 1 : close]))
    return Instr(name.lstrip("%"), shape, rest[:paren].strip(), operands, attrs)


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """Split the module into computations; returns them and the ENTRY computation's name."""
    comps: dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            # Header lines start at column 0 and open a brace; module attributes and the
            # FileNames/StackFrames tables after the computations never end in "{".
            if line[:1].isspace() or not line.rstrip().endswith("{") or line.startswith("HloModule"):
                continue
            header = strip_comments(line.strip())
            is_entry = header.startswith("ENTRY ")
            name, _, rest = header.removeprefix("ENTRY ").partition(" ")
            current = comps[name.lstrip("%")] = Computation(name.lstrip("%"))
            entry = current.name if is_entry else entry
            if rest.startswith("("):  # parameter shapes, for dots whose operands are parameters
                for param in split_top(rest[1 : close_bracket(rest, 0)]):
                    pname, _, pshape = param.partition(":")
                    current.shapes[pname.strip().lstrip("%")] = pshape.strip()
        elif line.strip() == "}":
            current = None
        elif (instr := parse_instr(line)) is not None:
            current.instrs.append(instr)
            current.shapes[instr.name] = instr.shape
    return comps, entry


def computations(hlo_text: str) -> dict[str, Computation]:
    """The module's computations by name, each with its instructions: name, result shape, opcode, operands and
    attributes (`metadata`, `calls`, `custom_call_target`, ... as written)."""
    return parse_module(hlo_text)[0]


def device_groups(attrs: dict[str, str], num_devices: int) -> DeviceGroups:
    """The devices of each group a collective runs over, as positions in the program's device assignment:
    for a jit over a Mesh, indices into mesh.devices.flat (SPMD programs number partitions, not device ids).
    A collective-permute's groups are its (source, target) pairs."""
    if "source_target_pairs" in attrs:
        return _int_groups(attrs["source_target_pairs"])
    groups = attrs.get("replica_groups", "{}")
    if groups in ("{}", "{{}}"):  # empty means one group of all devices
        return (tuple(range(num_devices)),)
    if groups.startswith("mesh["):
        return _mesh_groups(groups, attrs.get("device_ids", ""))
    if groups.startswith("["):  # iota form [groups,size]<=[dims]T(perm): a group is a row
        shape, _, order = groups.partition("<=")
        size, ids = int(shape[1 : shape.index("]")].split(",")[-1]), _iota(order)
        return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))
    return _int_groups(groups)  # explicit {{0,1},{2,3}}


def _int_groups(text: str) -> DeviceGroups:
    return tuple(tuple(int(d) for d in split_top(g.strip().strip("{}"))) for g in split_top(text.strip()[1:-1]))


def _iota(order: str) -> list[int]:
    """`[d0,d1,..]T(p0,p1,..)`: 0..N-1 laid out with dims d, transposed by p, read in row-major order."""
    dims_text, _, perm_text = order.strip().partition("T")
    dims = [int(d) for d in dims_text.strip().strip("[]").split(",")]
    perm = [int(p) for p in perm_text.strip().strip("()").split(",")] if perm_text else list(range(len(dims)))
    ids = []
    for flat in range(math.prod(dims)):
        index, rest = [0] * len(dims), flat
        for axis in reversed(perm):  # the transposed array's last dim varies fastest
            index[axis], rest = rest % dims[axis], rest // dims[axis]
        ids.append(sum(i * math.prod(dims[a + 1 :]) for a, i in enumerate(index)))
    return ids


def _mesh_groups(text: str, device_ids: str) -> DeviceGroups:
    """`mesh['a'=4,'b'=2] {'a'}`: devices that differ only along the listed axes form a group. An axis
    may be a sub-axis, 'b':(1)2 (Shardy's notation: the axis split major to minor into parts of size
    1 (pre-size), 2 and the rest). The mesh's devices are 0..N-1 in row-major order unless it lists
    `device_ids=(...)`, which the attribute splitter files under its own key, with the axes after it."""
    axes_text, _, chosen = text[len("mesh[") :].partition("]")
    names, sizes = [], []
    for axis in split_top(axes_text):
        name, _, size = axis.partition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    order = list(range(math.prod(sizes)))
    if not chosen.strip() and "{" in device_ids:
        ids_text, _, chosen = device_ids.rpartition("{")
        chosen, ids_text = "{" + chosen, ids_text.strip().removeprefix("(").removesuffix(")")
        listed = (
            _iota(ids_text.partition("<=")[2])
            if "<=" in ids_text
            else [int(d) for d in "".join(c if c.isdigit() else " " for c in ids_text).split()]
        )
        order = listed if len(listed) == len(order) else order
    parts: dict[int, list[tuple[int, int]]] = {}  # mesh axis -> (pre-size, size) of each listed part
    for axis in split_top(chosen.strip().strip("{}")):
        name, colon, sub = axis.partition(":")
        i = names.index(name.strip().strip("'\""))
        sub = sub.strip()
        parts.setdefault(i, []).append(
            (int(sub[1 : sub.index(")")]), int(sub.partition(")")[2])) if colon else (1, sizes[i])
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, device in enumerate(order):
        coords, rest = [], position
        for n in reversed(sizes):
            coords.insert(0, rest % n)
            rest //= n
        # Zero the listed parts of each coordinate: what is left names the group.
        key = tuple(
            c - sum((c // (n // (pre * size))) % size * (n // (pre * size)) for pre, size in parts.get(i, ()))
            for i, (c, n) in enumerate(zip(coords, sizes))
        )
        groups.setdefault(key, []).append(device)
    return tuple(tuple(g) for g in groups.values())
