"""The custom-scalars layout: what its first screen shows, that TensorBoard reads it back, and the screenshot tool."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from framework.observe.layout import layout

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TAGS = ["train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "best/val/acc", "best/val/loss",
        "lr/default", "lr/no_decay", "lr_plan/default", "grad_norm/total", "perf/step_ms", "amp/scale", "epoch"]


def matched(chart: list, tags: list[str] = TAGS) -> list[str]:
    """The tags a Multiline chart draws, matched as TensorBoard's custom-scalars plugin does (re.match)."""
    kind, regexes = chart
    assert kind == "Multiline"
    return [tag for tag in tags if any(re.match(regex, tag) for regex in regexes)]


def test_first_category_shows_loss_then_monitor_then_lr():
    first_category, charts = next(iter(layout(["val/acc"]).items()))
    assert first_category == "overview"
    assert [matched(chart) for chart in charts.values()] == [
        ["train/loss", "val/loss"], ["val/acc"], ["lr/default", "lr/no_decay"]]


def test_lr_of_every_group_is_one_chart_with_the_lr_regex():
    lr_charts = [chart for charts in layout(["val/acc"]).values() for chart in charts.values()
                 if any(regex.startswith("^lr/") for regex in chart[1])]
    assert lr_charts == [["Multiline", [r"^lr/.*$"]]]
    assert matched(lr_charts[0], [f"lr/{group}" for group in ("default", "no_decay", "head", "backbone")]) \
        == ["lr/default", "lr/no_decay", "lr/head", "lr/backbone"]


def test_best_is_not_first_and_the_rest_follows_the_overview():
    categories = list(layout(["val/acc"]))
    assert categories[0] == "overview" and categories[-1] == "best"
    assert categories.index("train") < categories.index("val") < categories.index("test")
    assert {"grad_norm", "perf", "amp"} <= set(categories)


def test_a_loss_monitor_is_drawn_once_in_the_loss_chart_and_several_monitors_each_get_a_chart():
    assert list(layout(["val/loss"])["overview"]) == ["loss", "learning rate (lr/<group>)"]
    overview = layout(["val/f1", "val/acc", "val/f1"])["overview"]
    assert list(overview) == ["loss", "val/f1", "val/acc", "learning rate (lr/<group>)"]
    assert matched(overview["val/f1"], ["val/f1", "best/val/f1", "val/f1_macro"]) == ["val/f1"]


def test_written_layout_reads_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from torch.utils.tensorboard import SummaryWriter

    expected = layout(["val/acc"])
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        writer.add_custom_scalars(expected)

    accumulator = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert accumulator.Tags()["tensors"] == [metadata.CONFIG_SUMMARY_TAG]
    assert accumulator.SummaryMetadata(metadata.CONFIG_SUMMARY_TAG).plugin_data.plugin_name == metadata.PLUGIN_NAME
    (event,) = accumulator.Tensors(metadata.CONFIG_SUMMARY_TAG)
    stored = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    read_back = {category.title: {chart.title: ["Multiline", list(chart.multiline.tag)] for chart in category.chart}
                 for category in stored.category}
    assert read_back == expected
    assert list(read_back) == list(expected)  # the order TensorBoard shows them in


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_screenshot_tool_saves_a_png_of_each_page(tmp_path):
    from PIL import Image
    from torch.utils.tensorboard import SummaryWriter

    for lr in (0.01, 0.1):  # two tiny runs written directly: no training needed to exercise the tool
        with SummaryWriter(log_dir=str(tmp_path / "runs" / f"lr={lr}")) as writer:
            for step in range(1, 4):
                for tag, value in {"train/loss": 1 / step, "val/loss": 1.2 / step, "val/acc": 1 - 0.5 / step,
                                   "lr/default": lr}.items():
                    writer.add_scalar(tag, value, step)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tensorboard_screenshot.py"), "--logdir",
                           str(tmp_path / "runs"), "--out", str(tmp_path / "png"), "--budget-ms", "4000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    paths = [Path(line) for line in proc.stdout.split()]
    assert [p.name for p in paths] == ["tensorboard_custom_scalars.png", "tensorboard_timeseries.png",
                                       "tensorboard_hparams.png"]
    assert [Image.open(path).size for path in paths] == [(1400, 1000), (1400, 1000), (2000, 700)]
