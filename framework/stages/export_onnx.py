"""ONNX for `python -m framework export`: the model exported through `torch.onnx.export(..., dynamo=True)` and run
back with onnxruntime, so the export can be checked against the eager model.

onnx, onnxscript and onnxruntime are an optional extra (`pip install 'hydra-torch-framework[export]'`); they are
imported here only, when ONNX is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from framework.core.errors import UserError

ONNX_FILE = "model.onnx"
ONNX_TOLERANCE = 1e-4  # absolute: onnxruntime must reproduce the eager outputs to this
MISSING = "ONNX export needs onnx, onnxscript and onnxruntime: pip install 'hydra-torch-framework[export]'"
# protobuf holds at most 2 GiB: a model's weights above this go beside it, in model.onnx.data
EXTERNAL_DATA_BYTES = 1 << 30


def available() -> bool:
    """Are the three packages ONNX export needs importable?"""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise the one line saying what to install, before any work, when ONNX is asked for and cannot be made."""
    if not available():
        raise UserError(MISSING)


def to_onnx(model: torch.nn.Module, batch: torch.Tensor, path: Path) -> None:
    """Write `model`, in eval mode, as ONNX at `path`, exported on `batch`: its batch dimension dynamic where the
    model allows it (torch.export's Dim.AUTO: a model whose code fixes the batch size gets a fixed one)."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    try:
        torch.onnx.export(
            model,
            (batch,),
            str(path),
            dynamo=True,
            dynamic_shapes=({0: torch.export.Dim.AUTO},),
            input_names=["input"],
            output_names=["output"],
            external_data=size >= EXTERNAL_DATA_BYTES,
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001  (torch.export and the ONNX translation reject many constructs)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"ONNX export of {type(model).__name__} failed ({first[:300]}); expected a model torch.export can "
            "capture; --format torchscript exports without ONNX"
        ) from None


class OnnxModel:
    """The exported file run by onnxruntime on the CPU, called like the model: a tensor in, a tensor out."""

    def __init__(self, path: Path) -> None:
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0]

    @property
    def dynamic_batch(self) -> bool:
        """Does the program take any batch size (a named dimension), or only the one it was exported on?"""
        return not isinstance(self.input.shape[0], int)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        outputs: list[Any] = self.session.run(None, {self.input.name: batch.detach().cpu().numpy()})
        return torch.from_numpy(np.asarray(outputs[0]))
