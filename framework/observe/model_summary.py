"""The model summary a fit starts with, Lightning's ModelSummary: the task's parameters by module (its direct children
and any parameter it holds itself, or deeper with `max_depth`), trainable or not, and the totals. Read from the
parameters alone, with no forward pass: nothing runs, any model works, a sharded (DTensor) parameter counts its full
size and a meta one its shape. A parameter reached under several names (tied weights) counts once, in the first row
that holds it, so the rows add up to the total."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

from torch import nn


@dataclass(frozen=True)
class Row:
    name: str  # the module's (or parameter's) name in the task
    type: str  # its class (Parameter for a parameter held by a module whose children have rows of their own)
    params: int
    trainable: int


@dataclass(frozen=True)
class ModelSummary:
    rows: list[Row]
    size_mb: float  # the parameters' bytes in their own dtypes, in 10^6 bytes (as Lightning's estimate)
    shared: int  # elements of parameters reached under more than one name, each counted once

    @property
    def total(self) -> int:
        return sum(row.params for row in self.rows)

    @property
    def trainable(self) -> int:
        return sum(row.trainable for row in self.rows)


def summarize(task: nn.Module, max_depth: int = 1) -> ModelSummary:
    """Rows for the modules `max_depth` levels below `task` (-1: every leaf module), a shallower module without
    children, and each parameter held by a module that is broken down further: every parameter in exactly one row."""
    seen: set[int] = set()

    def row(name: str, kind: str, params: Iterable[nn.Parameter]) -> Row:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return Row(name, kind, sum(p.numel() for p in fresh), sum(p.numel() for p in fresh if p.requires_grad))

    def rows_below(module: nn.Module, prefix: str, depth: int) -> Iterator[Row]:
        for name, param in module.named_parameters(recurse=False):
            yield row(prefix + name, "Parameter", [param])
        for name, child in module.named_children():
            if depth + 1 == max_depth or next(child.children(), None) is None:
                yield row(prefix + name, type(child).__name__, child.parameters())
            else:
                yield from rows_below(child, f"{prefix}{name}.", depth + 1)

    rows = list(rows_below(task, "", 0))
    names = Counter(id(p) for _, p in task.named_parameters(remove_duplicate=False))
    shared = sum(p.numel() for p in task.parameters() if names[id(p)] > 1)
    size = sum(p.numel() * p.element_size() for p in task.parameters())
    return ModelSummary(rows, size / 1e6, shared)


def format_summary(summary: ModelSummary) -> str:
    """Lightning's table: `| Name | Type | Params | Trainable |`, then the totals (exact counts, not 1.2 K)."""
    header = ("", "Name", "Type", "Params", "Trainable")
    cells = [header] + [
        (str(i), r.name, r.type, f"{r.params:,}", f"{r.trainable:,}") for i, r in enumerate(summary.rows)
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        " | ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]
    rule = "-" * max(len(line) for line in lines)
    totals = [
        (f"{summary.trainable:,}", "Trainable params"),
        (f"{summary.total - summary.trainable:,}", "Non-trainable params"),
        (f"{summary.total:,}", "Total params"),
        (f"{summary.size_mb:,.3f}", "Total estimated model params size (MB)"),
    ]
    if summary.shared:
        totals.append((f"{summary.shared:,}", "Shared params (tied weights), counted once"))
    width = max(10, *(len(value) + 1 for value, _ in totals))
    return "\n".join([lines[0], rule, *lines[1:], rule, *(f"{value:<{width}}{what}" for value, what in totals)])
