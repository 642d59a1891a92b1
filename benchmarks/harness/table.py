"""A phase's printed table: its rows, each a metric with a value per target, and the columns
that compare them (added milliseconds or a ratio over the direct server, llama-router over
llama.cpp's router)."""

from __future__ import annotations

from dataclasses import dataclass

from .columns import COLUMNS, DIRECT, LABELS, LLAMACPP, ROUTER, ROUTERS


@dataclass
class Row:
    key: str
    label: str
    unit: str
    kind: str  # "latency": added ms vs direct; "rate": ratio vs direct; "info": none
    values: dict[str, float]


def _fmt(value: float) -> str:
    if value == int(value) and value < 1000:
        return str(int(value))
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


def render_table(rows: list[Row]) -> str:
    header = ["metric", LABELS[DIRECT], LABELS[LLAMACPP], LABELS[ROUTER],
              "llama.cpp vs direct", "llama-router vs direct", "llama-router / llama.cpp"]
    table = [header]
    for row in rows:
        v = row.values
        cells = [row.label if row.unit in row.label or row.unit == "count"
                 else f"{row.label} ({row.unit})",
                 *(_fmt(v[c]) for c in COLUMNS)]
        if row.kind == "latency":
            cells += [f"{v[c] - v[DIRECT]:+.3f} ms" for c in ROUTERS]
        elif row.kind == "rate":
            cells += [f"{v[c] / v[DIRECT]:.3f}x" for c in ROUTERS]
        else:
            cells += ["", ""]
        cells.append(f"{v[ROUTER] / v[LLAMACPP]:.2f}x"
                     if v[LLAMACPP] and row.unit != "count" else "")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |"
             for r in table]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + (":" if i else "-")
                                   for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)
