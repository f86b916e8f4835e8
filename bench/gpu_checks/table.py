"""gpu-check's table: one row per check (area, check, status, value, detail), and the figures' formats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    area: str
    check: str
    status: str  # pass | FAIL | info | skipped: why
    value: str = ""
    detail: str = ""


HEADER = Row("area", "check", "status", "value", "detail")


def format_table(rows: list[Row]) -> str:
    cells = [dataclasses.astuple(row) for row in [HEADER, *rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(dataclasses.fields(Row)) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]]).rstrip() for line in cells)


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def format_flops(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.2f} GFLOP/s"
