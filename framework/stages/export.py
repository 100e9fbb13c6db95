"""Export a trained model for use outside this framework, and prove the export computes what the checkpoint does.

    python -m framework export RUN_DIR_OR_CHECKPOINT [--format torchscript,onnx] [--which best|last] [--out DIR]
                               [--torchscript trace|script] [--raw] [--config-dir DIR]

The model is rebuilt from the config stored in the checkpoint's meta.json and given its `model.safetensors`, or,
when the run evaluated an EMA of its weights (callbacks.ema with use_for_eval), that average (`--raw`: the trained
ones).
Written to --out (default: RUN_DIR/export/):
- `model.safetensors`: the plain state dict (no `module.` prefix), for `model.load_state_dict(load_file(...))`;
- `model.pt` (--format torchscript): TorchScript, from `torch.jit.trace` on the example batch (default) or
  `torch.jit.script`; it runs without the Python class (`torch.jit.load`), but it is code: load trusted files only;
- `model.onnx` (--format onnx): ONNX, from `torch.onnx.export(..., dynamo=True)`, its batch dimension dynamic where
  the model allows it; it needs the `export` extra (onnx, onnxscript, onnxruntime);
- `export.json`: what each file was checked on and the largest absolute difference from the model it found.
The default format is torchscript and onnx, ONNX only where its packages are installed (a note says when not).
The example batch is real: the first batch of the run's val split (else test, else train), rebuilt from the saved
config (its inputs; at most 16 samples); where the data cannot be built (its files are gone), the model's or task's
`example_input_array` (Lightning's name). Every file is reloaded and run in eval mode on that batch and on a
second one (of another size where the batch dimension is dynamic) against the checkpoint's model: the weights must
give identical outputs, TorchScript outputs within rtol 1e-4 / atol 1e-5, onnxruntime's within 1e-4 absolute.
Where CUDA is available, the TorchScript file is also run on the batch on CUDA against the model there: a trace
records the device of each tensor the model makes (`torch.arange(n, device=x.device)` becomes the CPU), which fails
on CUDA inputs; without CUDA, a program holding such a device is named in a warning. Errors are one line and exit
code 1.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save

from framework.checkpoint import META_FILE, MODEL_FILE, Checkpoint, check_compatible, open_checkpoint
from framework.checkpoint.discovery import holds_run
from framework.config.instantiate import build, error_line
from framework.config.saved import from_checkpoint
from framework.config.trees import framework_conf_dir
from framework.config.trust import check_saved_targets, conf_targets
from framework.core import files
from framework.core.errors import ConfigError, UserError
from framework.loop.build import build_task
from framework.stages import export_onnx
from framework.stages.export_example import Example, batches_to_check, example_input

WEIGHTS_FILE, TORCHSCRIPT_FILE, REPORT_FILE = "model.safetensors", "model.pt", "export.json"
FORMATS = ("torchscript", "onnx")


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


def saved_config(
    checkpoint: Checkpoint,
    trust: bool = False,
    conf_dir: Optional[Path] = None,
    nodes: Sequence[str] = ("model", "data"),
) -> DictConfig:
    """The run's `nodes` (of those it has) and seed, as its checkpoint saved them. The stored config is data:
    unless `trust`, their targets must be ones the project's config tree (`conf_dir`, default ./conf), the
    framework's, the framework's package or the project's packages name (as on resume); only what is built is
    checked, so a node export does not build cannot stop it."""
    try:
        saved = from_checkpoint(checkpoint).config  # the one reader of a saved config (framework/config/saved.py)
    except ConfigError as err:
        raise UserError(str(err)) from None
    if not isinstance(saved.get("model"), dict) and checkpoint.meta.get("model_attr") != "":
        raise UserError(
            f"checkpoint {checkpoint.path}: its saved config has no model node; expected the config "
            "written by this framework"
        )
    cfg = OmegaConf.create({key: saved[key] for key in (*nodes, "seed") if saved.get(key) is not None})
    if not trust:
        project = Path.cwd()
        trees = [conf_dir or project / "conf", framework_conf_dir()]
        check_saved_targets(cfg, conf_targets(trees), project, f"the config saved in {checkpoint.path}")
    return cfg


def build_model(checkpoint: Checkpoint, trust: bool = False, conf_dir: Optional[Path] = None) -> torch.nn.Module:
    """The model as the stored config builds it (random weights), in eval mode."""
    return model_of(checkpoint, saved_config(checkpoint, trust, conf_dir, model_nodes(checkpoint)))


def model_nodes(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The saved config's nodes that build the checkpoint's model: the task's too where it is its own model."""
    return ("model", "data", "task") if checkpoint.meta.get("model_attr") == "" else ("model", "data")


def model_of(checkpoint: Checkpoint, cfg: DictConfig) -> torch.nn.Module:
    """The checkpoint's model, built from its saved `cfg` (random weights), in eval mode: the model group's, or the
    task itself where it built several nets (a GAN's generator and discriminator, its `forward` what is exported,
    as Lightning's to_onnx exports a LightningModule's)."""
    if checkpoint.meta.get("model_attr") != "":
        return build(cfg.model, "model").eval()
    task, _ = build_task(cfg)
    return task.eval()


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


@dataclass
class Exported:
    """What `export` wrote and found: the contents of export.json, the weights in words, the example."""

    report: dict[str, Any]
    which: str
    example: Example


def export(
    checkpoint: Checkpoint,
    out: Path,
    formats: Sequence[str] = ("torchscript",),
    mode: str = "trace",
    trust: bool = False,
    raw: bool = False,
    conf_dir: Optional[Path] = None,
    given_example: bool = False,
) -> Exported:
    """Write the weights and each of `formats` under `out`, reload them, check each against the checkpoint's
    model on real batches (raises UserError, one line, outside tolerance), and write what was found to
    export.json (the largest absolute difference of each format; with CUDA, TorchScript's on CUDA inputs too)."""
    cfg = saved_config(checkpoint, trust, conf_dir, model_nodes(checkpoint))
    model = model_of(checkpoint, cfg)
    weights, which = eval_weights(checkpoint, raw)
    check_compatible(model, weights, f"checkpoint {checkpoint.path}", strict=True)
    model.load_state_dict(weights)
    example = example_input(
        cfg, model, lambda: saved_config(checkpoint, trust, conf_dir, ("model", "task")), given=given_example
    )
    _expected(model, example.batch)

    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).unlink(missing_ok=True)  # an earlier export's findings must not outlive its files
    state = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}
    metadata = {"source": str(checkpoint.path), "step": str(checkpoint.step)}
    files.write_bytes(out / WEIGHTS_FILE, save(state, metadata=metadata))
    fresh = model_of(checkpoint, cfg)
    fresh.load_state_dict(load_file(str(out / WEIGHTS_FILE)))
    checked = compare(fresh, model, batches_to_check(model, example, dynamic=True)[0], torch.equal, WEIGHTS_FILE)
    if not checked.within:
        raise UserError(
            f"{out / WEIGHTS_FILE}: the reloaded weights give different outputs (max abs difference "
            f"{checked.max_abs_diff:.3g}); expected identical ones"
        )
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint.path),
        "step": checkpoint.step,
        "weights": which.split(" (")[0],
        "example": {"source": example.source, "shape": list(example.batch.shape), "dtype": _dtype(example.batch)},
        "safetensors": {"file": WEIGHTS_FILE, **checked.as_json()},
    }
    if "torchscript" in formats:
        report.update(export_torchscript(model, example, out / TORCHSCRIPT_FILE, mode))
    if "onnx" in formats:
        report["onnx"] = export_to_onnx(model, example, out / export_onnx.ONNX_FILE)
    files.write_json(out / REPORT_FILE, report)
    return Exported(report, which, example)


@dataclass
class Check:
    """An export's outputs against the model's on some batches."""

    max_abs_diff: float
    batch_sizes: list[int]
    within: bool  # every batch's outputs within the format's tolerance

    def as_json(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "batches": len(self.batch_sizes), "batch_sizes": self.batch_sizes}


def compare(
    run: Callable[[torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    close: Callable[[torch.Tensor, torch.Tensor], bool],
    name: str,
) -> Check:
    """`run`'s outputs on each batch against the model's (eval mode, no grad); `close(got, expected)` is the
    format's tolerance. Outputs of another shape differ by infinity; a batch `run` fails on is one line."""
    largest, within = 0.0, True
    with torch.no_grad():
        for batch in batches:
            expected = model(batch)
            try:
                got = run(batch)
            except Exception as err:  # noqa: BLE001  (TorchScript's and onnxruntime's errors are many-lined)
                raise UserError(
                    f"{name} does not run on a batch of {len(batch)}, which the model takes ({error_line(err)[:300]})"
                ) from None
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                return Check(float("inf"), [len(b) for b in batches], False)
            got = got.to(expected.device, expected.dtype)
            largest = max(largest, (got - expected).abs().max().item() if expected.numel() else 0.0)
            within = within and close(got, expected)
    return Check(largest, [len(b) for b in batches], within)


def export_torchscript(model: torch.nn.Module, example: Example, path: Path, mode: str) -> dict[str, Any]:
    """Write the TorchScript file, reload it and check it on the example and a batch of another size (rtol 1e-4,
    atol 1e-5); with CUDA, on CUDA inputs too. Returns export.json's entries for it."""
    program = to_torchscript(model, example.batch, mode)
    with files.private_dir(path.parent) as scratch:  # TorchScript writes the file itself: never through a link
        program.save(str(scratch / path.name))
        files.publish(scratch / path.name, path)
    scripted = _load_torchscript(path, "cpu")
    batches, _ = batches_to_check(model, example, dynamic=True)
    checked = compare(scripted, model, batches, lambda a, b: torch.allclose(a, b, 1e-4, 1e-5), f"{path} ({mode})")
    if not checked.within:
        raise UserError(
            f"{path}: TorchScript ({mode}) outputs differ from the model's by up to {checked.max_abs_diff:.3g} on "
            f"batches of {_sizes(checked)}; expected allclose (rtol 1e-4, atol 1e-5)"
            + ("; a data-dependent branch or batch size may need --torchscript script" if mode == "trace" else "")
        )
    entries: dict[str, Any] = {"torchscript": {"file": path.name, "mode": mode, **checked.as_json()}}
    if torch.cuda.is_available():
        diff = verify_on_cuda(path, model, example.batch, mode)
        entries["torchscript_cuda"] = {"max_abs_diff": diff, "batches": 1, "batch_sizes": [len(example.batch)]}
    else:
        warning = fixed_device_warning(scripted, path, mode)
        example.warnings.extend([warning] if warning else [])
    return entries


def export_to_onnx(model: torch.nn.Module, example: Example, path: Path) -> dict[str, Any]:
    """Write the ONNX file, run it with onnxruntime (CPU) and check it on the example and a second batch, of another
    size where its batch dimension is dynamic (1e-4 absolute). Returns export.json's entry for it."""
    with files.private_dir(path.parent) as scratch:  # torch.onnx writes the file itself: never through a link
        export_onnx.to_onnx(model, example.batch, scratch / path.name)
        files.publish(scratch / path.name, path)
    onnx_model = export_onnx.OnnxModel(path)
    batches, dynamic = batches_to_check(model, example, onnx_model.dynamic_batch)
    tolerance = export_onnx.ONNX_TOLERANCE
    checked = compare(onnx_model, model, batches, lambda a, b: bool((a - b).abs().max() <= tolerance), f"{path}")
    if not checked.within:
        raise UserError(
            f"{path}: onnxruntime's outputs differ from the model's by up to {checked.max_abs_diff:.3g} on "
            f"batches of {_sizes(checked)}; expected at most {tolerance:g} (absolute)"
        )
    return {"file": path.name, "dynamic_batch": dynamic, **checked.as_json()}


def _sizes(checked: Check) -> str:
    return " and ".join(str(n) for n in checked.batch_sizes)


def _expected(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The model's output on the example batch, which the exported files must reproduce."""
    try:
        with torch.no_grad():
            expected = model(batch)
    except Exception as err:  # noqa: BLE001  (whatever the user's forward raises)
        raise UserError(
            f"{type(model).__name__} did not run on the example batch, {_described(batch)} "
            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
            "export expects a model taking one tensor: the inputs of the run's batches, or, with "
            "--example-input-array, one like its example_input_array attribute (a generator's noise, say)"
        ) from None
    if not isinstance(expected, torch.Tensor):
        raise UserError(
            f"{type(model).__name__} returned a {type(expected).__name__}; export expects a model "
            "returning one tensor (the exported files' outputs are compared with it)"
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


def _dtype(batch: torch.Tensor) -> str:
    return str(batch.dtype).removeprefix("torch.")


def _described(batch: torch.Tensor) -> str:
    dtype = _dtype(batch)
    return f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {list(batch.shape)}"


def check_out(out: Path) -> None:
    """Export writes only where nothing of a run is: never into a checkpoint (its files are shared with the run's
    other checkpoints by hard links), anywhere under a `checkpoints/` folder, or into a run directory itself (its
    default, RUN_DIR/export, is a folder of its own); and a file at `--out` is not a folder to write into."""
    expected = "expected a new or export-only folder, e.g. RUN_DIR/export (the default)"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out={str(out)!r}: a file, not a folder; {expected}")
    real = out.resolve()
    inside = [real, *real.parents]
    if any(
        (folder / META_FILE).exists() or folder.name == "checkpoints" and holds_run(folder.parent) for folder in inside
    ):
        raise UserError(
            f"--out={str(out)!r}: inside a checkpoint, whose files export would replace (every checkpoint of the "
            f"run shares them); {expected}"
        )
    if holds_run(real):
        raise UserError(f"--out={str(out)!r}: a run directory, which export never writes into; {expected}")


def default_out(checkpoint: Checkpoint) -> Path:
    """RUN_DIR/export for a checkpoint inside RUN_DIR/checkpoints/, else CHECKPOINT/export."""
    path = checkpoint.path.resolve()
    return path.parent.parent / "export" if path.parent.name == "checkpoints" else path / "export"


def parse_formats(value: str) -> tuple[str, ...]:
    """--format's value: a comma-separated list of FORMATS."""
    names = tuple(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected a comma-separated list of {', '.join(FORMATS)}, e.g. torchscript,onnx"
        )
    return names


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m framework export", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory or a checkpoint directory")
    parser.add_argument(
        "--format",
        type=parse_formats,
        default=None,
        help="what to write beside model.safetensors, comma-separated: torchscript (model.pt), onnx (model.onnx). "
        "Default: both, ONNX only where onnx, onnxscript and onnxruntime are installed (pip install "
        "'hydra-torch-framework[export]'); asking for onnx without them is an error",
    )
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
        "--example-input-array",
        action="store_true",
        help="export on the model's (else the task's) example_input_array, not on a batch of the data: a model "
        "whose input is not the data's (a GAN's generator takes noise)",
    )
    parser.add_argument(
        "--raw", action="store_true", help="export the trained weights even where the run evaluated an EMA of them"
    )
    parser.add_argument(
        "--trust-saved-config",
        action="store_true",
        help="build the model and data even if the saved config names targets this project does not",
    )
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="your config tree, whose targets the saved config may name (default: ./conf)",
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    formats, notes = args.format, []
    if formats is None:
        formats = FORMATS if export_onnx.available() else ("torchscript",)
        notes = [] if "onnx" in formats else [f"no model.onnx: {export_onnx.MISSING}"]
    try:
        if "onnx" in formats:
            export_onnx.require()
        checkpoint = find_checkpoint(args.path, args.which)
        out = args.out or default_out(checkpoint)
        check_out(out)
        exported = export(
            checkpoint,
            out,
            formats,
            args.torchscript,
            args.trust_saved_config,
            args.raw,
            args.config_dir,
            args.example_input_array,
        )
    except UserError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a folder it cannot make or write, a disk that is full: the path, in one line
        where = err.filename or args.out or args.path
        print(f"Error: {where}: {err.strerror or err}; expected a folder this user can write to", file=sys.stderr)
        return 1
    for warning in exported.example.warnings:
        print(f"Warning: {warning}", file=sys.stderr)
    for note in notes:
        print(f"Note: {note}", file=sys.stderr)
    print(summary(checkpoint, out, exported))
    return 0


def summary(checkpoint: Checkpoint, out: Path, exported: Exported) -> str:
    """What was written, and how close each file came to the model, for the console."""
    report, example = exported.report, exported.example
    files = [f"  {out / WEIGHTS_FILE}  weights (state dict)"]
    diffs = [f"weights {report['safetensors']['max_abs_diff']:.3g} (identical)"]
    if "torchscript" in report:
        files.append(f"  {out / TORCHSCRIPT_FILE}  TorchScript ({report['torchscript']['mode']})")
        diffs.append(f"TorchScript {report['torchscript']['max_abs_diff']:.3g}")
    if "onnx" in report:
        batch = "dynamic" if report["onnx"]["dynamic_batch"] else f"fixed at {len(example.batch)}"
        files.append(f"  {out / export_onnx.ONNX_FILE}  ONNX (batch dimension {batch})")
        diffs.append(f"ONNX (onnxruntime) {report['onnx']['max_abs_diff']:.3g}")
    if "torchscript_cuda" in report:
        diffs.append(f"TorchScript on CUDA {report['torchscript_cuda']['max_abs_diff']:.3g}")
    seconds = {n for entry in report.values() if isinstance(entry, dict) for n in entry.get("batch_sizes", ())[1:]}
    return (
        f"Exported {checkpoint.path} (step {checkpoint.step}), {exported.which}:\n"
        + "\n".join(files)
        + f"\n  {out / REPORT_FILE}  the checks\n"
        f"Verified in eval mode on the {example.source}, {_described(example.batch)}"
        + (f", and a second of {' or '.join(map(str, sorted(seconds)))} samples" if seconds else "")
        + f", max abs difference: {', '.join(diffs)}"
    )
