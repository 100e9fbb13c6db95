"""Writing WebDataset tar shards (what `data=webdataset` reads), and the digits written as PNG shards:

    python -m framework.zoo.shards DIR

writes DIR/{train,val,test}-NNNNNN.tar from the same split as `data=digits` (framework/zoo/datasets.py), and prints
the command line that trains on them.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from framework.shards import TarShards
from framework.streaming import expand_braces
from framework.zoo.datasets import digits


def png(image: np.ndarray) -> bytes:
    """A uint8 H x W (grey) or H x W x 3 array as PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def write_tar(path: Path, samples: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    """One shard: for each `(key, {ext: bytes})`, the files KEY.ext, in order (written to a temporary name first)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")  # processes writing the same shard do not mix
    with tarfile.open(partial, "w") as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    partial.replace(path)


def write_image_shards(
    folder: Path, prefix: str, images: torch.Tensor, labels: Sequence[int], per_shard: int
) -> list[Path]:
    """`images` (N x 1 x H x W or N x 3 x H x W, values in [0, 1]) as PNG + .cls samples keyed by their index."""
    folder.mkdir(parents=True, exist_ok=True)
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    paths = []
    for number, first in enumerate(range(0, len(pixels), per_shard)):
        path = folder / f"{prefix}-{number:06d}.tar"
        rows = range(first, min(first + per_shard, len(pixels)))
        samples = ((f"{i:06d}", {"png": png(pixels[i].squeeze(-1)), "cls": str(int(labels[i])).encode()}) for i in rows)
        write_tar(path, samples)
        paths.append(path)
    return paths


def write_digits(folder: Path, per_shard: int = 128) -> dict[str, str]:
    """The digits' train, val and test splits as shards; returns each split's brace pattern."""
    patterns = {}
    for split in ("train", "val", "test"):
        images, labels = digits(split).tensors
        paths = write_image_shards(folder, split, images, labels.tolist(), per_shard)
        patterns[split] = f"{folder}/{split}-{{000000..{len(paths) - 1:06d}}}.tar"
    return patterns


def digits_shards(shards: Optional[str], root: str, split: str, **options: Any) -> TarShards:
    """`TarShards(shards, ...)`; with `shards` null, the digits' `split` (data=digits' split), written once as PNG
    shards under `root`/digits_shards: what `data=webdataset` reads when no shards are given."""
    if shards is None:
        folder = Path(root) / "digits_shards"
        done = folder / "counts.json"
        if not done.is_file():
            counts = {name: _shards_in(pattern) for name, pattern in write_digits(folder).items()}
            partial = folder / f"counts.json.{os.getpid()}.part"
            partial.write_text(json.dumps(counts))
            partial.replace(done)
        count = json.loads(done.read_text())[split]
        shards = f"{folder}/{split}-{{000000..{count - 1:06d}}}.tar"
    return TarShards(shards, **options)


def _shards_in(pattern: str) -> int:
    return len(expand_braces(pattern))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m framework.zoo.shards DIR")
    found = write_digits(Path(sys.argv[1]).resolve())
    print(
        "python run.py data=webdataset "
        + " ".join(f"\"data.{split}_shards='{pattern}'\"" for split, pattern in found.items())
    )
