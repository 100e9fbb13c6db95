"""The LR range test's plot (framework/stages/lr_find.py): loss against learning rate on a log axis, the suggestion
marked. matplotlib draws it when it is installed (its object API and Agg canvas: no pyplot, no global figure state);
else Pillow (torchvision's dependency, so always there) draws the same lines plainly."""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path
from typing import BinaryIO, Optional

import numpy as np

from framework.core import files

SIZE = (640, 420)  # pixels


def plot(
    lrs: list[float], smoothed: list[float], raw: list[float], suggestion: Optional[float], path: Path
) -> np.ndarray:
    """Write the PNG to `path` (through framework.core.files); return its pixels (height, width, RGB) for
    TensorBoard."""
    draw = with_matplotlib if importlib.util.find_spec("matplotlib") is not None else with_pillow
    png = io.BytesIO()
    draw(lrs, smoothed, raw, suggestion, png)
    files.write_bytes(path, png.getvalue())
    from PIL import Image

    png.seek(0)
    with Image.open(png) as image:
        return np.asarray(image.convert("RGB"))


def with_matplotlib(
    lrs: list[float], smoothed: list[float], raw: list[float], suggestion: Optional[float], out: BinaryIO
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(SIZE[0] / 100, SIZE[1] / 100), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(lrs, raw, color="0.75", linewidth=0.8, label="loss")
    axes.plot(lrs, smoothed, color="C0", label="smoothed loss")
    if suggestion is not None:
        axes.axvline(suggestion, color="C3", linestyle="--", label=f"suggested lr {suggestion:.3g}")
    axes.set_xscale("log")
    axes.set_xlabel("learning rate")
    axes.set_ylabel("training loss")
    axes.set_ylim(*_loss_range(smoothed, raw))
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, format="png")


def with_pillow(
    lrs: list[float], smoothed: list[float], raw: list[float], suggestion: Optional[float], out: BinaryIO
) -> None:
    from PIL import Image, ImageDraw

    width, height = SIZE
    left, right, top, bottom = 60, width - 20, 20, height - 40
    image = Image.new("RGB", SIZE, "white")
    pen = ImageDraw.Draw(image)
    low, high = _loss_range(smoothed, raw)
    x_low, x_high = math.log10(lrs[0]), math.log10(lrs[-1]) if len(lrs) > 1 else math.log10(lrs[0]) + 1

    def point(lr: float, loss: float) -> tuple[float, float]:
        x = left + (math.log10(lr) - x_low) / ((x_high - x_low) or 1) * (right - left)
        y = bottom - (min(max(loss, low), high) - low) / ((high - low) or 1) * (bottom - top)
        return x, y

    pen.rectangle((left, top, right, bottom), outline="black")
    for series, colour in ((raw, (190, 190, 190)), (smoothed, (31, 119, 180))):
        points = [point(lr, loss) for lr, loss in zip(lrs, series) if math.isfinite(loss)]
        if len(points) > 1:
            pen.line(points, fill=colour, width=2)
    if suggestion is not None:
        x = point(suggestion, low)[0]
        pen.line((x, top, x, bottom), fill=(214, 39, 40), width=1)
        pen.text((x + 4, top + 4), f"suggested lr {suggestion:.3g}", fill=(214, 39, 40))
    for exponent in range(math.ceil(x_low), math.floor(x_high) + 1):  # a tick per power of ten
        x = point(10.0**exponent, low)[0]
        pen.line((x, bottom, x, bottom + 5), fill="black")
        pen.text((x - 12, bottom + 8), f"1e{exponent}", fill="black")
    pen.text((left, height - 16), "learning rate (log)", fill="black")
    pen.text((4, top), f"{high:.3g}", fill="black")
    pen.text((4, bottom - 10), f"{low:.3g}", fill="black")
    image.save(out, format="PNG")


def _loss_range(smoothed: list[float], raw: list[float]) -> tuple[float, float]:
    """The loss axis: from the lowest loss to a little over the first smoothed one (the divergence at the end
    would squash the part that matters)."""
    finite = [v for v in (*smoothed, *raw) if math.isfinite(v)] or [0.0, 1.0]
    low = min(finite)
    start = next((v for v in smoothed if math.isfinite(v)), max(finite))
    high = max(start, low) * 1.1 + 1e-12
    return low - 0.05 * (high - low), high
