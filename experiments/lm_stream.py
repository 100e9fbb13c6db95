"""`experiment=lm_stream`: the byte-level LM of experiments/lm.py, trained from a token stream of tar shards.

`stdlib_token_shards` writes the standard library's source (the same bytes and train/val cut as `StdlibText`) as
WebDataset shards of `.bin` members under `root` the first time, then reads them as a
`framework.shards.TokenShards`: a streaming split (framework/streaming.py), every window once per epoch, resumable
at any batch. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

from experiments.lm import stdlib_bytes
from framework.shards import TokenShards
from framework.zoo.shards import write_tar


def stdlib_token_shards(root: str, split: str = "train", block_size: int = 64, val_fraction: float = 0.05,
                        shard_bytes: int = 1 << 20) -> TokenShards:
    """The `split` ("train" or "val") of the standard library's source as shards under `root` (written once)."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")
    folder = Path(root) / "stdlib_shards"
    done = folder / f"{split}.count"
    if not done.is_file():
        data = stdlib_bytes()
        cut = int(len(data) * (1.0 - val_fraction))
        part = data[:cut] if split == "train" else data[cut:]
        folder.mkdir(parents=True, exist_ok=True)
        chunks = range(0, len(part), shard_bytes)
        for number, start in enumerate(chunks):
            write_tar(folder / f"{split}-{number:06d}.tar", [(f"{number:06d}", {"bin": part[start:start + shard_bytes]})])
        done.write_text(str(len(chunks)))
    count = int(done.read_text())
    return TokenShards(f"{folder}/{split}-{{000000..{count - 1:06d}}}.tar", block_size=block_size,
                       key=f"data.{split}")
