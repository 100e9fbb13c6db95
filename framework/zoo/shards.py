"""Writing WebDataset tar shards (what `data=webdataset` reads), and the digits written as PNG shards:

    python -m framework.zoo.shards DIR

writes DIR/{train,val,test}-NNNNNN.tar from the same split as `data=digits` (framework/zoo/datasets.py), and prints
the command line that trains on them; no DIR, or one it cannot write, is one `Error:` line. `data=webdataset`
without shards reads the same digits from the user's cache (`cache_dir`), written there once. Every file goes through
framework.core.files: a shard is whole or absent, whenever the writer is stopped.
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

from framework.core import files
from framework.core.errors import UserError
from framework.data.shards import TarShards
from framework.data.streaming import expand_braces
from framework.zoo.datasets import digits

USAGE = "python -m framework.zoo.shards DIR"


def png(image: np.ndarray) -> bytes:
    """A uint8 H x W (grey) or H x W x 3 array as PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def write_tar(path: Path, samples: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    """One shard: for each `(key, {ext: bytes})`, the files KEY.ext, in order (renamed into place once whole)."""
    with files.replacing(path) as out, tarfile.open(fileobj=out, mode="w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")  # mtime 0: the same samples make the same bytes
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


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


def cache_dir() -> Path:
    """Where what every run reads the same is written once: $XDG_CACHE_HOME/hydra-torch-framework, else
    ~/.cache/hydra-torch-framework (the XDG base directories' default, where pip's and torch's caches are too)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hydra-torch-framework"


def digits_shards(shards: Optional[str], root: Optional[str], split: str, **options: Any) -> TarShards:
    """`TarShards(shards, ...)`; with `shards` null, the digits' `split` (data=digits' split), written once as PNG
    shards under `root`/digits_shards, or with `root` null under `cache_dir()`/digits_shards: what `data=webdataset`
    reads when no shards are given."""
    if shards is None:
        folder = (Path(root) if root is not None else cache_dir()) / "digits_shards"
        count = _digits_written(folder)[split]
        shards = f"{folder}/{split}-{{000000..{count - 1:06d}}}.tar"
    return TarShards(shards, **options)


def _digits_written(folder: Path) -> dict[str, int]:
    """Each split's number of shards in `folder` (its counts.json, renamed into place last), the shards written first
    if they are not there. Processes that find none at once (DDP's ranks, a sweep's jobs) each write the same bytes
    in a folder of their own and rename each file into place: a reader never meets a shard half-written."""
    done = folder / "counts.json"
    if not done.is_file():
        with files.private_dir(folder) as scratch:
            counts = {split: len(expand_braces(pattern)) for split, pattern in write_digits(scratch).items()}
            for shard in sorted(scratch.glob("*.tar")):
                files.publish(shard, folder / shard.name)
            files.write_json(scratch / done.name, counts)
            files.publish(scratch / done.name, done)
    return json.loads(done.read_text())


def main(argv: list[str]) -> int:
    """`python -m framework.zoo.shards DIR`: 0 with the shards written and the line that trains on them printed; 1
    with one `Error:` line for a mistake or a folder it cannot write."""
    try:
        if len(argv) != 1:
            raise UserError(f"expected one argument, the folder to write the shards into: {USAGE}")
        folder = Path(argv[0]).resolve()
        try:
            found = write_digits(folder)
        except OSError as err:
            raise UserError(
                f"DIR={str(folder)!r}: cannot write {err.filename or folder} ({err.strerror or err}); expected a "
                "folder this user can write (made if missing)"
            ) from None
    except UserError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    print(
        "python run.py data=webdataset "
        + " ".join(f"\"data.{split}_shards='{pattern}'\"" for split, pattern in found.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
