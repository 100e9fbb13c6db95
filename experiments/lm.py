"""A small byte-level transformer language model, trained on text every Python install ships: the standard
library's own source files. Nothing to download; big enough to shard (`experiment=lm_fsdp`, two processes
under parallel=fsdp), small enough to train a couple of hundred steps in a minute or two on two CPU cores.

- `StdlibText`: the bytes of `<stdlib>/*.py` (the folder holding `os.py`), sorted by name and concatenated.
  The first `1 - val_fraction` of them is the training split, the rest validation (contiguous, so no sample
  straddles both); a sample is a window of `block_size + 1` bytes, windows `block_size` apart.
- `next_token_batch`: the DataModule's `collate_fn`: windows -> (inputs, targets), targets shifted by one byte.
- `TransformerLM`: token and position embeddings, pre-norm `nn.TransformerEncoderLayer`s under a causal mask,
  a final LayerNorm and a linear head: logits of shape (batch, time, 256).
- `LanguageModelTask`: next-byte cross-entropy; validation adds `val/acc` (next-byte accuracy) and
  `val/ppl`, the perplexity of the whole split (exp of its mean loss per byte, over every rank).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from framework.task.task import StepOutput, Task

VOCAB_SIZE = 256  # bytes


@functools.lru_cache(maxsize=2)
def stdlib_bytes(max_bytes: Optional[int] = None) -> bytes:
    """The standard library's top-level .py files, sorted by name, concatenated (at most `max_bytes`)."""
    folder = Path(os.__file__).parent
    data = b"".join(path.read_bytes() for path in sorted(folder.glob("*.py")))
    return data[:max_bytes] if max_bytes is not None else data


class StdlibText(Dataset):
    """Windows of `block_size + 1` bytes of the standard library's source, as uint8 tensors."""

    def __init__(self, split: str = "train", block_size: int = 128, val_fraction: float = 0.05,
                 max_bytes: Optional[int] = None) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r}: expected a fraction between 0 and 1")
        data = stdlib_bytes(max_bytes)
        cut = int(len(data) * (1.0 - val_fraction))
        part = data[:cut] if split == "train" else data[cut:]
        self.data = torch.frombuffer(bytearray(part), dtype=torch.uint8)
        self.block_size = block_size
        self.windows = max(0, (len(part) - 1) // block_size)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.block_size
        return self.data[start: start + self.block_size + 1]


def next_token_batch(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A list of windows of `block_size + 1` bytes -> (inputs, targets), both (batch, block_size) int64: each
    target is the byte following its input."""
    batch = torch.stack(windows).long()
    return batch[:, :-1], batch[:, 1:]


class TransformerLM(nn.Module):
    """A GPT-style decoder built from PyTorch's own pre-norm encoder layers under a causal mask."""

    def __init__(self, block_size: int = 128, d_model: int = 128, num_layers: int = 4, num_heads: int = 4,
                 ff_mult: int = 4, dropout: float = 0.0, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, num_heads, ff_mult * d_model, dropout, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block_size), persistent=False)
        # What `python -m framework export` traces and verifies the model on (Lightning's name): token ids.
        self.example_input_array = torch.randint(vocab_size, (2, block_size),
                                                 generator=torch.Generator().manual_seed(0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        # The first `length` rows of the position table: no tensor made on a device, so a traced export runs anywhere.
        x = self.tokens(tokens) + self.positions.weight[:length]
        mask = self.mask[:length, :length]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class LanguageModelTask(Task):
    """Next-byte prediction on (inputs, targets) batches of byte indices."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._totals: dict[str, torch.Tensor] = {}  # split -> [sum of losses over bytes, bytes], on the device

    def metric_modes(self) -> dict[str, str]:
        """Next-byte accuracy is better higher, perplexity lower: what best/val/acc and best/val/ppl are kept by."""
        return {"acc": "max", "ppl": "min"}

    def training_step(self, batch: Any) -> StepOutput:
        inputs, targets = batch
        logits = self.model(inputs)
        return StepOutput(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))

    def validation_step(self, batch: Any) -> StepOutput:
        return self.evaluation_step(batch, "val")

    def test_step(self, batch: Any) -> StepOutput:
        return self.evaluation_step(batch, "test")

    def evaluation_step(self, batch: Any, split: str) -> StepOutput:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if targets.numel():  # (a step on no samples, which a sharded model's ranks may run, counts nothing)
            total = self._totals.setdefault(split, torch.zeros(2, device=loss.device))
            total[0] += loss.detach() * targets.numel()
            total[1] += targets.numel()
        return StepOutput(loss, {"acc": (logits.argmax(-1) == targets).float().mean()})

    def epoch_metrics(self, split: str) -> dict[str, torch.Tensor]:
        """The split's perplexity over every byte of every rank (every rank calls this), then reset."""
        total = self._totals.pop(split, None)
        if total is None:
            total = torch.zeros(2, device=next(self.model.parameters()).device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        return {"ppl": torch.exp(total[0] / total[1])}
