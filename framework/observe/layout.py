"""The custom-scalars layout of a run: which charts TensorBoard's CUSTOM SCALARS page shows, in what order.

The plain SCALARS / TIME SERIES pages group tags by their prefix in alphabetical order (`amp`, `best`,
`grad_norm`, `lr`, ...), so what matters most would not come first there. This layout puts loss, the
monitored metric(s) and the learning rate of every parameter group on the first screen, the rest after.
Pass it to `SummaryWriter.add_custom_scalars` once per run.
"""

from __future__ import annotations

import re
from typing import Sequence

Chart = list  # ["Multiline", [tag regex, ...]]: one line per matching tag (regexes are re.match'ed)
Layout = dict[str, dict[str, Chart]]

OVERVIEW = "overview"
LOSS_TAGS = ("train/loss", "train/loss_epoch", "val/loss")  # every logging step, each epoch's mean, validation
# Their units differ (samples/s, ms, fraction, MB; a scale and a count), so one chart each.
PERF_TAGS = ("perf/samples_per_s", "perf/step_ms", "perf/data_wait_frac", "perf/max_memory_mb")
AMP_TAGS = ("amp/scale", "amp/skipped_steps")


def layout(monitors: Sequence[str]) -> Layout:
    """{category: {chart title: ["Multiline", [tag regexes]]}}, categories in the order shown.

    `monitors`: the metrics callbacks, checkpoints and schedulers watch (e.g. ["val/acc"]); each gets a
    chart of its own on the first screen, except a loss already drawn in the loss chart."""
    overview: dict[str, Chart] = {"loss": _multiline(*LOSS_TAGS)}
    for monitor in dict.fromkeys(monitors):
        if monitor not in LOSS_TAGS:
            overview[monitor] = _multiline(monitor)
    overview["learning rate (lr/<group>)"] = ["Multiline", [r"^lr/.*$"]]
    return {
        OVERVIEW: overview,
        "train": {"train/*": _prefix("train")},
        "val": {"val/*": _prefix("val")},
        "test": {"test/*": _prefix("test")},
        "grad_norm": {"grad_norm/*": _prefix("grad_norm")},
        "perf": {tag: _multiline(tag) for tag in PERF_TAGS},
        "amp": {tag: _multiline(tag) for tag in AMP_TAGS},
        "lr_plan": {"lr_plan/* (the scheduler's plan)": _prefix("lr_plan")},
        "best": {"best/*": _prefix("best")},
    }


def _multiline(*tags: str) -> Chart:
    return ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]]


def _prefix(prefix: str) -> Chart:
    return ["Multiline", [f"^{re.escape(prefix)}/.*$"]]
