"""`experiment=lm_stream`: the byte-level LM of experiments/lm.py, trained from a token stream of tar shards.

`stdlib_token_shards` writes the standard library's source (the same bytes and train/val cut as `StdlibText`) as
WebDataset shards of `.bin` members in the user's cache (or `root`) the first time, then reads them as a
`framework.data.shards.TokenShards`: a streaming split (framework/data/streaming.py), every window once per epoch, resumable
at any batch. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from experiments.lm import stdlib_bytes
from framework.core import files
from framework.data.shards import TokenShards
from framework.zoo.shards import cache_dir, write_tar


def stdlib_token_shards(root: Optional[str], split: str = "train", block_size: int = 64, val_fraction: float = 0.05,
                        shard_bytes: int = 1 << 20) -> TokenShards:
    """The `split` ("train" or "val") of the standard library's source as shards under `root`/stdlib_shards, or
    with `root` null under the user's cache (framework.zoo.shards.cache_dir), written once: every run of this
    Python reads the same bytes. Processes that find none at once each write them in a folder of their own and
    rename each file into place, the count last: a reader never meets a shard half-written."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")
    folder = (Path(root) if root is not None else cache_dir()) / "stdlib_shards"
    done = folder / f"{split}-{val_fraction}.count"
    if not done.is_file():
        data = stdlib_bytes()
        cut = int(len(data) * (1.0 - val_fraction))
        part = data[:cut] if split == "train" else data[cut:]
        chunks = range(0, len(part), shard_bytes)
        with files.private_dir(folder) as scratch:
            for number, start in enumerate(chunks):
                name = f"{split}-{val_fraction}-{number:06d}.tar"
                write_tar(scratch / name, [(f"{number:06d}", {"bin": part[start:start + shard_bytes]})])
                files.publish(scratch / name, folder / name)
            files.write_text(scratch / done.name, str(len(chunks)))
            files.publish(scratch / done.name, done)
    count = int(done.read_text())
    return TokenShards(f"{folder}/{split}-{val_fraction}-{{000000..{count - 1:06d}}}.tar", block_size=block_size,
                       key=f"data.{split}")
