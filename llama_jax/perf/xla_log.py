"""What XLA says while it compiles a step, for `llama-jax plan` to report.

XLA logs from C++ to the process's stderr (file descriptor 2), not through Python's sys.stderr, so the log is read
from the descriptor: `captured()` points it at a temporary file for the compile, then writes what came to the
real stderr as it would have appeared, and keeps a copy.

The one message read: the SPMD partitioner's "Involuntary full rematerialization". It means the partitioner found
no collective that takes a tensor from one sharding to another, so it replicated the tensor whole on every
device and sliced it again: memory and traffic the layout did not intend, and a sign that the parameters' rules
and the activations' shardings disagree (docs/recipe.md has the case of the long-context layout).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from llama_jax.model.jax_workarounds import compilation_cache_off

REMATERIALIZATION = "Involuntary full rematerialization"
_OPERATION = re.compile(r'op_name="(?:jit\([^)]*\)/)?([^"]*)"')
_HLO = re.compile(r"HLO operation %\S+ = \S+ ([\w-]+)\(")


@contextlib.contextmanager
def captured(log: list[str]) -> Iterator[None]:
    """Run the block with file descriptor 2 going to a temporary file; then write what it caught to the real
    stderr and append it to `log`. The persistent compilation cache is off inside: a step loaded from it is
    not compiled again, and XLA would say nothing."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            with compilation_cache_off():
                yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read()
            os.write(2, text)
            log.append(text.decode(errors="replace"))


def rematerializations(log: str) -> tuple[str, ...]:
    """The operations the partitioner replicated whole, in the order XLA logged them: by the model's name for
    each (its op_name, without the jit(...) prefix), or where it has none by its kind of HLO operation."""
    names = []
    for line in (line for line in log.splitlines() if REMATERIALIZATION in line):
        named, hlo = _OPERATION.search(line), _HLO.search(line)
        names.append(named.group(1) if named else f"an unnamed {hlo.group(1) if hlo else 'operation'}")
    return tuple(names)


def describe(operations: tuple[str, ...]) -> str:
    """One line for the plan: how many tensors were replicated, and where (each name's last two parts, counted)."""
    counts = collections.Counter("/".join(op.split("/")[-2:]) for op in operations)
    where = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.most_common())
    return (
        f"WARNING: XLA's partitioner replicated {len(operations)} tensor(s) whole to reshard them (involuntary "
        f"full rematerialization): {where}. The mesh rules of the parameters and the activations' shardings "
        "disagree there, so the step moves and holds more than its layout says (the log above names them)"
    )
