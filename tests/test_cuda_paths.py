"""The CUDA paths (issue 29). What can be shown on the CPU runs everywhere: DataParallel's replicas keep the run's
autocast dtype in their own threads, FSDP's cpu_offload joins gloo beside nccl, the task's own parameters and
buffers follow it under FSDP, fp16 reads the GradScaler's scale once per step, and parallel=dp refuses
trainer.compile. The rest needs a GPU and skips without one: `make gpu-check` runs it all on a machine with CUDA
(every precision under every strategy, fsdp with cpu_offload, compile, a resume on fewer GPUs, an export run on
CUDA, pinned memory with a CNN in channels_last)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, output, run_cli
from omegaconf import OmegaConf
from torch import nn
from torch.overrides import TorchFunctionMode

from framework.config.validate import validate
from framework.core.errors import ConfigError
from framework.parallel.precision import Precision
from framework.parallel.group import default_backend
from framework.parallel.strategy import DataParallelStrategy, FSDPStrategy, SingleDevice, Strategy, build_strategy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")

# A run that trains a few steps, validates, checkpoints and writes its summary.
TINY = ("trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.test=false")


# ---------------------------------------------------------------------------------------------- item 1: dp autocast
@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel moves a module to cuda:0 where CUDA is "
                    "visible; the CUDA test below is this one on the GPU")
def test_dp_replica_computes_in_the_runs_dtype_inside_a_thread_that_only_enables_autocast():
    """DataParallel's parallel_apply runs each replica in a thread under `autocast(device, enabled=True)` with no
    dtype, which is the device's default there (autocast's dtype is thread-local). On the CPU that default is
    bf16, so a run in fp16 shows it as a bf16 run shows it on CUDA (whose default is fp16)."""
    model = nn.Linear(4, 4)
    wrapped = DataParallelStrategy(torch.device("cpu")).wrap(model, param_dtype=torch.float16)
    assert isinstance(wrapped, nn.DataParallel)
    replica, dtypes = wrapped.module, []

    def worker() -> None:  # as torch.nn.parallel.parallel_apply's _worker
        with torch.autocast("cpu", enabled=True):
            dtypes.append(replica(torch.randn(2, 4)).dtype)

    with torch.autocast("cpu", dtype=torch.float16):  # the run's context, in the main thread
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert dtypes == [torch.float16]
    assert SingleDevice(torch.device("cpu")).unwrap(wrapped) is model  # saved without any wrapper's prefix


@cuda
@pytest.mark.unit
def test_dp_replicas_run_by_torchs_parallel_apply_compute_in_bf16():
    model = nn.Linear(8, 8).cuda()
    replica = DataParallelStrategy(torch.device("cuda", 0)).wrap(model, param_dtype=torch.bfloat16).module
    x = torch.randn(4, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # two replicas on one GPU: two threads all the same
        outputs = nn.parallel.parallel_apply([replica, replica], [(x,), (x,)], devices=[0, 0])
    assert [out.dtype for out in outputs] == [torch.bfloat16, torch.bfloat16]


# ---------------------------------------------------------------------------------------------- item 2: fsdp offload
@pytest.mark.unit
def test_fsdp_cpu_offload_on_cuda_reduces_cpu_tensors_over_gloo_beside_nccl():
    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_backend(cuda0, offload=True) == "cpu:gloo,cuda:nccl"  # offloaded gradients are CPU tensors
    assert default_backend(cuda0, offload=False) == "nccl"
    assert default_backend(cpu, offload=True) == default_backend(cpu) == "gloo"


# ---------------------------------------------------------------------------------------------- item 13: placement
class TaskWithItsOwnState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(3, 3)
        self.loss = nn.CrossEntropyLoss(weight=torch.ones(3))  # a child: moved before the fix too
        self.temperature = nn.Parameter(torch.ones(()), requires_grad=False)
        self.register_buffer("class_weights", torch.ones(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


@pytest.mark.unit
def test_fsdp_places_the_tasks_own_parameters_and_buffers_and_leaves_the_model_to_wrap():
    task = TaskWithItsOwnState()
    meta = SingleDevice(torch.device("meta"))  # FSDPStrategy.place reads only the device; no process group needed
    FSDPStrategy.place(meta, task, task.model)  # type: ignore[arg-type]
    assert task.temperature.is_meta and isinstance(task.temperature, nn.Parameter)
    assert not task.temperature.requires_grad
    assert task.class_weights.is_meta and task.scratch.is_meta and task.loss.weight.is_meta
    assert set(task.state_dict()) == {"model.weight", "model.bias", "loss.weight", "temperature", "class_weights"}
    assert not any(p.is_meta for p in task.model.parameters())  # its shards are moved by wrap


@pytest.mark.unit
def test_building_a_sharded_run_places_the_tasks_own_state():
    from framework.loop.build import place

    class ShardedOnMeta(SingleDevice):
        sharded = True
        place = FSDPStrategy.place

    task = TaskWithItsOwnState()
    place(OmegaConf.create({}), task, "model", ShardedOnMeta(torch.device("meta")))  # type: ignore[arg-type]
    assert task.class_weights.is_meta and task.temperature.is_meta
    assert not any(p.is_meta for p in task.model.parameters())


# ---------------------------------------------------------------------------------------------- item 7: scale syncs
class HostReads(TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host: each is a host-device sync on CUDA."""

    READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def _fp16_backward(model: nn.Module, backward: Any, inf: bool = False) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 4)).float().mean()  # sum() * 65536 would overflow fp16 itself
    backward(loss)
    if inf:
        next(model.parameters()).grad.fill_(float("inf"))


@pytest.mark.unit
def test_fp16_step_reads_the_scale_once_and_still_tells_a_skipped_step():
    torch.manual_seed(0)
    plain, model = nn.Linear(4, 4), nn.Linear(4, 4)
    scaler, plain_opt = torch.amp.GradScaler("cpu"), torch.optim.SGD(plain.parameters(), lr=0.1)
    precision, optimizer = Precision("fp16", torch.device("cpu")), torch.optim.SGD(model.parameters(), lr=0.1)
    _fp16_backward(plain, lambda loss: scaler.scale(loss).backward())
    with HostReads() as gradscaler_own:  # GradScaler.step reads found_inf itself: not ours to remove
        scaler.unscale_(plain_opt)
        scaler.step(plain_opt)
        scaler.update()
    _fp16_backward(model, precision.backward)
    with HostReads() as ours:
        assert precision.step(optimizer, model.parameters(), None, None)
    assert ours.count == gradscaler_own.count + 1
    assert precision.scale == precision.scaler.get_scale() == 65536.0

    _fp16_backward(model, precision.backward, inf=True)
    assert not precision.step(optimizer, model.parameters(), None, None)  # skipped: the scheduler stays
    assert precision.skipped_steps == 1 and precision.scale == precision.scaler.get_scale() == 32768.0

    resumed = Precision("fp16", torch.device("cpu"))
    resumed.load_state_dict(precision.state_dict())
    assert resumed.scale == 32768.0  # what the first step after a resume compares with
    assert Precision("bf16", torch.device("cpu")).scale is None


# ---------------------------------------------------------------------------------------------- item 9: dp + compile
@pytest.mark.unit
def test_dp_with_compile_is_refused_in_one_line_naming_both_keys(compose):
    with pytest.raises(ConfigError) as err:
        validate(compose("parallel=dp", "trainer.compile=true"))
    message = str(err.value)
    assert message.startswith("trainer.compile=true: expected false with parallel=dp"), message
    assert "\n" not in message
    validate(compose("parallel=dp"))
    validate(compose("trainer.compile=true"))


# ---------------------------------------------------------------------------------------------- items 5, 10: devices
@cuda
@pytest.mark.unit
def test_amp_picks_bf16_only_where_the_runs_own_gpu_has_it_natively():
    for index in range(GPUS):
        device = torch.device("cuda", index)
        native = torch.cuda.get_device_capability(device) >= (8, 0)
        expected = "bf16-autocast" if native else "fp16-autocast+gradscaler"
        assert Precision("amp", device).name == expected, torch.cuda.get_device_name(device)


@two_gpus
@pytest.mark.unit
def test_single_on_cuda_n_makes_cuda_n_the_current_device(compose):
    previous = torch.cuda.current_device()
    last = GPUS - 1
    try:
        strategy = build_strategy(compose("parallel=single").parallel, f"cuda:{last}")
        assert strategy.device == torch.device("cuda", last)
        assert torch.cuda.current_device() == last
    finally:
        torch.cuda.set_device(previous)


# ---------------------------------------------------------------------------------------------- runs on CUDA
def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def expected_precision(mode: str) -> str:
    return {"fp32": "fp32", "bf16": "bf16-autocast", "fp16": "fp16-autocast+gradscaler"}[mode]


# fsdp refuses fp16 (validate): its GradScaler would not see gradients sharded over ranks.
MATRIX = [(s, p) for s in ("single", "dp", "ddp", "fsdp") for p in ("fp32", "bf16", "fp16")
          if (s, p) != ("fsdp", "fp16")]


@cuda
@pytest.mark.e2e
@pytest.mark.parametrize(("strategy", "mode"), MATRIX, ids=[f"{s}-{p}" for s, p in MATRIX])
def test_every_precision_trains_under_every_strategy_on_the_visible_gpus(tmp_path, strategy, mode):
    if mode == "bf16" and torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("bf16 is emulated below compute capability 8.0")
    proc = run_cli(tmp_path, f"parallel={strategy}", f"precision={mode}", *TINY, timeout=600)
    assert proc.returncode == 0, output(proc)
    summary = summary_of(tmp_path)
    assert summary["precision"] == expected_precision(mode)
    assert summary["step"] == 4 and math.isfinite(summary["val/loss"])


@cuda
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_fsdp_with_cpu_offload_clips_and_monitors_gradients(tmp_path, mode):
    if mode == "bf16" and torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("bf16 is emulated below compute capability 8.0")
    proc = run_cli(tmp_path, "parallel=fsdp", "parallel.cpu_offload=true", f"precision={mode}",
                   "trainer.grad_clip_norm=1.0", *TINY, timeout=600)  # the default callbacks: GradNormMonitor
    assert proc.returncode == 0, output(proc)
    assert summary_of(tmp_path)["step"] == 4


@cuda
@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_compiled_model_trains_on_cuda(tmp_path, strategy):
    proc = run_cli(tmp_path, f"parallel={strategy}", "trainer.compile=true", *TINY, timeout=600)
    assert proc.returncode == 0, output(proc)
    assert summary_of(tmp_path)["step"] == 4


@two_gpus
@pytest.mark.e2e
def test_a_run_that_saw_every_gpu_resumes_where_one_is_visible(tmp_path):
    """The checkpoint's CUDA RNG state must not need as many visible GPUs as the saving process saw."""
    run_dir = tmp_path / "run"
    first = run_cli(run_dir, "trainer.max_epochs=1", "trainer.test=false", timeout=600)
    assert first.returncode == 0, output(first)
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    resumed = run_cli(None, f"resume={run_dir}", "trainer.max_epochs=2", env=one_gpu, fast=False, timeout=600)
    assert resumed.returncode == 0, output(resumed)
    assert summary_of(run_dir)["epoch"] == 2


@cuda
@pytest.mark.e2e
def test_an_export_of_a_model_that_makes_tensors_on_its_inputs_device_runs_on_cuda(tmp_path):
    from experiments.lm import TransformerLM
    from framework.checkpoint import open_checkpoint

    proc = run_cli(tmp_path, "experiment=lm", "trainer.max_steps=4", "trainer.val_every_n_steps=2",
                   "checkpoint.every_n_steps=2", "trainer.limit_val_batches=1", timeout=600)
    assert proc.returncode == 0, output(proc)
    # traced and verified as a user exports (experiments/lm.py makes its positions on the tokens' device)
    exported = run_cli_module("framework", "export", str(tmp_path), "--which", "last")
    assert exported.returncode == 0, output(exported)
    scripted = torch.jit.load(str(tmp_path / "export" / "model.pt"), map_location="cuda")
    cfg = OmegaConf.load(tmp_path / ".hydra" / "config.yaml").model
    model = TransformerLM(**{k: v for k, v in cfg.items() if k != "_target_"}).cuda().eval()
    model.load_state_dict(open_checkpoint(tmp_path / "checkpoints" / "last").model_state())
    tokens = torch.randint(256, (2, cfg.block_size), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(scripted(tokens), model(tokens), rtol=1e-4, atol=1e-4)


def run_cli_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@cuda
@pytest.mark.unit
def test_a_cnn_in_channels_last_trains_from_pinned_batches(compose, tmp_path):
    from framework.loop.trainer import Trainer

    cfg = compose("logger.progress_bar=false", "model=cnn", "data=fake", "data.pin_memory=true", *TINY)
    trainer = Trainer(cfg, tmp_path)
    inputs, _ = next(iter(trainer.run.data.batches("train")))
    assert inputs.is_pinned()  # copied to the GPU with non_blocking=True
    trainer.run.task.model.to(memory_format=torch.channels_last)
    summary = trainer.fit()
    assert summary["step"] == 4 and torch.isfinite(torch.tensor(summary["train/loss"]))
    conv = next(m for m in trainer.run.task.model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)



# ---------------------------------------------------------------------------------------------- make gpu-check
@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, gpu-check runs the CUDA tests themselves")
def test_gpu_check_without_cuda_says_so_in_one_line_and_succeeds(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out, out
