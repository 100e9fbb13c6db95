"""Export a trained model for use outside this framework, and prove the export computes what the checkpoint does.

    python -m framework.export RUN_DIR_OR_CHECKPOINT [--which best|last] [--out DIR]
                               [--torchscript trace|script] [--raw] [--config-dir DIR]

The model is rebuilt from the config stored in the checkpoint's meta.json and given its `model.safetensors`, or,
when the run evaluated an EMA of its weights (callbacks.ema with use_for_eval), that average (`--raw`: the trained
ones).
Written to --out (default: RUN_DIR/export/):
- `model.safetensors`: the plain state dict (no `module.` prefix), for `model.load_state_dict(load_file(...))`;
- `model.pt`: TorchScript, from `torch.jit.trace` on the example batch (default) or `torch.jit.script`; it runs
  without the Python class (`torch.jit.load`), but it is code: load trusted files only.
The example batch is the model's own `example_input_array` when it has one (Lightning's name: a model taking
token ids, say, gives a batch of them), else a random float batch of shape [2, *data.input_shape].
Both files are then reloaded and run on that batch in eval mode against the checkpoint's model: the weights must
give identical outputs, TorchScript outputs within float tolerance. Where CUDA is available, the TorchScript file
is also run on the batch on CUDA against the model there: a trace records the device of each tensor the model makes
(`torch.arange(n, device=x.device)` becomes the CPU), which fails on CUDA inputs; without CUDA, a program holding
such a device is named in a warning. Errors are one line and exit code 1.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save

from framework.checkpoint import META_FILE, MODEL_FILE, Checkpoint, check_compatible, open_checkpoint
from framework.errors import UserError
from framework.instantiate import build
from framework.resume import as_data, check_saved_targets, conf_targets, framework_conf_dir

WEIGHTS_FILE, TORCHSCRIPT_FILE = "model.safetensors", "model.pt"


def find_checkpoint(path: Path, which: Optional[str]) -> Checkpoint:
    """`path` is a checkpoint directory, or a run directory whose checkpoints/<which> is exported
    (which=None: best if the run has one, else last)."""
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; expected a run directory or a checkpoint directory")
    if (path / META_FILE).is_file() or (path / MODEL_FILE).is_file():
        return open_checkpoint(path)
    folder = path / "checkpoints"
    if not folder.is_dir():
        raise UserError(
            f"{path}: neither a checkpoint directory (with {META_FILE}) nor a run directory with "
            "checkpoints/; expected e.g. outputs/NAME/TIME or outputs/NAME/TIME/checkpoints/best"
        )
    which = which or ("best" if (folder / "best").is_dir() else "last")
    if not (folder / which).is_dir():
        saved = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_dir())) or "none"
        raise UserError(
            f"{path}: no checkpoints/{which} (saved: {saved}); expected a run that saved one "
            "(checkpoint=default saves last and best)"
        )
    return open_checkpoint(folder / which)


def build_model(checkpoint: Checkpoint, trust: bool = False, conf_dir: Optional[Path] = None) -> torch.nn.Module:
    """The model as the stored config builds it (random weights), in eval mode. The stored config is data:
    unless `trust`, its targets must be ones the project's config tree (`conf_dir`, default ./conf), the
    framework's, the framework's package or the project's packages name (as on resume)."""
    saved = checkpoint.meta["config"]
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UserError(
            f"checkpoint {checkpoint.path}: its saved config has no model node; expected the config "
            "written by this framework"
        )
    cfg = OmegaConf.create(as_data({"model": saved["model"]}))
    if not trust:
        project = Path.cwd()
        trees = [conf_dir or project / "conf", framework_conf_dir()]
        check_saved_targets(cfg, conf_targets(trees), project, f"the config saved in {checkpoint.path}")
    return build(cfg.model, "model").eval()


def example_batch(checkpoint: Checkpoint, model: torch.nn.Module) -> torch.Tensor:
    """The model's `example_input_array` (a tensor), else a float batch of [2, *data.input_shape]."""
    example = getattr(model, "example_input_array", None)
    if isinstance(example, torch.Tensor):
        return example
    if example is not None:
        raise UserError(
            f"{type(model).__name__}.example_input_array is a {type(example).__name__}; export expects "
            "one tensor (the batch the model is traced and verified on)"
        )
    shape = checkpoint.meta["config"].get("data", {}).get("input_shape")
    if not shape:
        raise UserError(
            f"checkpoint {checkpoint.path}: its config has no data.input_shape and the model no "
            "example_input_array; expected the shape of one input, e.g. data.input_shape=[3,32,32], "
            "to build the example batch"
        )
    return torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))


def to_torchscript(model: torch.nn.Module, batch: torch.Tensor, mode: str) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():  # TorchScript is deprecated upstream; the warning says nothing actionable here
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=FutureWarning)
        try:
            if mode == "script":
                return torch.jit.script(model)
            with torch.no_grad():  # for inference, as it is verified: modules with an inference fast path
                return torch.jit.trace(model, batch)  # (nn.TransformerEncoderLayer) then trace the same each time
        except Exception as err:  # noqa: BLE001  (TorchScript rejects many Python constructs)
            other = "script" if mode == "trace" else "trace"
            raise UserError(
                f"--torchscript {mode} failed: {str(err).strip().splitlines()[0]}; try --torchscript {other}"
            ) from None


def eval_weights(checkpoint: Checkpoint, raw: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """The weights the run evaluated: a weight-averaging callback's (EMA with use_for_eval) when the checkpoint
    has one, else the trained ones; and which they are, in words."""
    weights = checkpoint.model_state()
    if raw:
        return weights, "trained weights"
    callbacks = checkpoint.state().get("callbacks") or {}
    for name, state in callbacks.items() if isinstance(callbacks, dict) else ():
        averaged = state.get("weights") if isinstance(state, dict) and state.get("use_for_eval") is True else None
        if isinstance(averaged, dict) and set(averaged) == set(weights):
            return averaged, f"EMA weights (callbacks.{name}; --raw exports the trained ones)"
    return weights, "trained weights"


def export(
    checkpoint: Checkpoint,
    out: Path,
    mode: str = "trace",
    trust: bool = False,
    raw: bool = False,
    conf_dir: Optional[Path] = None,
) -> tuple[dict[str, float], str, torch.Tensor, Optional[str]]:
    """Write the two files under `out`, reload them, and return the max abs difference of each from the
    checkpoint's model on the example batch (raises UserError when outside tolerance; with CUDA, TorchScript's on
    CUDA inputs too), which weights were exported, that batch, and a warning when, without CUDA to try it, the
    TorchScript program fixes the device its tensors are made on."""
    model = build_model(checkpoint, trust, conf_dir)
    weights, which = eval_weights(checkpoint, raw)
    check_compatible(model, weights, f"checkpoint {checkpoint.path}", strict=True)
    model.load_state_dict(weights)
    batch = example_batch(checkpoint, model)
    expected = _expected(model, batch)

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}
    metadata = {"source": str(checkpoint.path), "step": str(checkpoint.step)}
    (out / WEIGHTS_FILE).write_bytes(save(state, metadata=metadata))
    to_torchscript(model, batch, mode).save(str(out / TORCHSCRIPT_FILE))

    fresh = build_model(checkpoint, trust, conf_dir)
    fresh.load_state_dict(load_file(str(out / WEIGHTS_FILE)))
    scripted = _load_torchscript(out / TORCHSCRIPT_FILE, "cpu")
    with torch.no_grad():
        got = {WEIGHTS_FILE: fresh(batch), TORCHSCRIPT_FILE: scripted(batch)}
    diffs = {name: (value - expected).abs().max().item() for name, value in got.items()}
    if not torch.equal(got[WEIGHTS_FILE], expected):
        raise UserError(
            f"{out / WEIGHTS_FILE}: the reloaded weights give different outputs (max abs difference "
            f"{diffs[WEIGHTS_FILE]:.3g}); expected identical ones"
        )
    if not torch.allclose(got[TORCHSCRIPT_FILE], expected, rtol=1e-4, atol=1e-5):
        raise UserError(
            f"{out / TORCHSCRIPT_FILE}: TorchScript ({mode}) outputs differ from the model's by up to "
            f"{diffs[TORCHSCRIPT_FILE]:.3g}; expected allclose (rtol 1e-4, atol 1e-5)"
            + ("; a data-dependent branch may need --torchscript script" if mode == "trace" else "")
        )
    if torch.cuda.is_available():
        diffs[CUDA] = verify_on_cuda(out / TORCHSCRIPT_FILE, fresh, batch, mode)
        return diffs, which, batch, None
    return diffs, which, batch, fixed_device_warning(scripted, out / TORCHSCRIPT_FILE, mode)


def _expected(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The model's output on the example batch, which the exported files must reproduce."""
    try:
        with torch.no_grad():
            expected = model(batch)
    except Exception as err:  # noqa: BLE001  (whatever the user's forward raises)
        raise UserError(
            f"{type(model).__name__} did not run on the example batch, {_described(batch)} "
            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
            "export expects a model taking one tensor: a float one of data.input_shape, or one "
            "like its example_input_array attribute"
        ) from None
    if not isinstance(expected, torch.Tensor):
        raise UserError(
            f"{type(model).__name__} returned a {type(expected).__name__}; export expects a model "
            "returning one tensor (TorchScript outputs are compared with it)"
        )
    return expected


def _load_torchscript(path: Path, device: str) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=FutureWarning)
        return torch.jit.load(str(path), map_location=device).eval()


CUDA = "model.pt on CUDA"  # the key of TorchScript's difference on CUDA inputs


def verify_on_cuda(path: Path, model: torch.nn.Module, batch: torch.Tensor, mode: str) -> float:
    """Run the TorchScript file at `path` on the example batch on CUDA, against `model` (left where it is) there:
    a trace records the device of every tensor the model makes (`torch.arange(n, device=x.device)` becomes the
    CPU), which then fails or differs on CUDA inputs. Returns the max abs difference; raises UserError, one line,
    when the program does not run on CUDA or differs beyond tolerance (rtol 1e-3, atol 1e-4: CUDA kernels)."""
    device = torch.device("cuda")
    on_cuda, inputs = copy.deepcopy(model).to(device).eval(), batch.to(device)
    scripted = _load_torchscript(path, "cuda")
    baked = _baked_in(scripted)
    advice = f"; the {'traced' if mode == 'trace' else 'scripted'} program baked in {baked}: " if baked else ""
    advice += _advice(mode) if baked else ""
    with torch.no_grad():
        expected = on_cuda(inputs)
        try:
            got = scripted(inputs)
        except Exception as err:  # noqa: BLE001  (TorchScript's runtime errors are many-lined)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"{path}: TorchScript ({mode}) does not run on CUDA inputs ({first[:200]}){advice}"
            ) from None
    diff = (got.to(expected.device) - expected).abs().max().item()
    if got.device != expected.device or not torch.allclose(got.to(expected.device), expected, rtol=1e-3, atol=1e-4):
        raise UserError(
            f"{path}: TorchScript ({mode}) on CUDA inputs gives outputs on {got.device} differing from the model's "
            f"by up to {diff:.3g}; expected allclose on {expected.device} (rtol 1e-3, atol 1e-4){advice}"
        )
    return diff


def fixed_device_warning(scripted: torch.jit.ScriptModule, path: Path, mode: str) -> Optional[str]:
    """A warning when the program makes tensors on a device it fixed (a trace of `torch.arange(n, device=x.device)`
    records the CPU): it would fail on CUDA inputs, which this machine cannot try."""
    baked = _baked_in(scripted)
    if not baked:
        return None
    return (
        f"{path}: the TorchScript ({mode}) program baked in {baked} for tensors it makes, so it will fail on "
        f"CUDA inputs (not tried: no CUDA here); {_advice(mode)}"
    )


def _baked_in(scripted: torch.jit.ScriptModule) -> str:
    """The devices the program's graph holds as constants, in words ('' if none): where it makes tensors."""
    devices = sorted(
        {
            str(node.output().toIValue())
            for node in scripted.inlined_graph.nodes()
            if node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType"
        }
    )
    if not devices:
        return ""
    return "the CPU device" if devices == ["cpu"] else f"the device(s) {', '.join(devices)}"


def _advice(mode: str) -> str:
    if mode == "trace":  # a trace records the device of each tensor the model makes (pytorch #145995)
        return (
            "export with --torchscript script, which keeps `x.device`, or make the model device-agnostic "
            "(slice a parameter or buffer, e.g. self.positions.weight[:length], rather than create a tensor on "
            "the input's device)"
        )
    return "expected a model that creates its tensors on its input's device (device=x.device), not a fixed one"


def _described(batch: torch.Tensor) -> str:
    dtype = str(batch.dtype).removeprefix("torch.")
    return f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {list(batch.shape)}"


def default_out(checkpoint: Checkpoint) -> Path:
    """RUN_DIR/export for a checkpoint inside RUN_DIR/checkpoints/, else CHECKPOINT/export."""
    path = checkpoint.path.resolve()
    return path.parent.parent / "export" if path.parent.name == "checkpoints" else path / "export"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory or a checkpoint directory")
    parser.add_argument(
        "--which",
        choices=("best", "last"),
        default=None,
        help="which checkpoint of a run directory (default: best if saved, else last)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/export)")
    parser.add_argument(
        "--torchscript",
        choices=("trace", "script"),
        default="trace",
        help="how model.pt is made (default: trace, on the example batch)",
    )
    parser.add_argument(
        "--raw", action="store_true", help="export the trained weights even where the run evaluated an EMA of them"
    )
    parser.add_argument(
        "--trust-saved-config",
        action="store_true",
        help="build the model even if the saved config names targets this project does not",
    )
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="your config tree, whose targets the saved config may name (default: ./conf)",
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = find_checkpoint(args.path, args.which)
        out = args.out or default_out(checkpoint)
        diffs, which, batch, warning = export(
            checkpoint, out, args.torchscript, args.trust_saved_config, args.raw, args.config_dir
        )
    except UserError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if warning is not None:
        print(f"Warning: {warning}", file=sys.stderr)
    print(
        f"Exported {checkpoint.path} (step {checkpoint.step}), {which}:\n"
        f"  {out / WEIGHTS_FILE}  weights (state dict)\n"
        f"  {out / TORCHSCRIPT_FILE}  TorchScript ({args.torchscript})\n"
        f"Verified on the example batch, {_described(batch)}, in eval mode, max abs difference: "
        f"weights {diffs[WEIGHTS_FILE]:.3g} (identical), TorchScript {diffs[TORCHSCRIPT_FILE]:.3g}"
        + (f", TorchScript on CUDA {diffs[CUDA]:.3g}" if CUDA in diffs else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
