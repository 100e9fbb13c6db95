"""Streaming splits: any `torch.utils.data.IterableDataset`, read in a planned order, every sample once per epoch.

An epoch's order is a pure function of (seed, epoch) over the samples' positions in storage order (shard after
shard): the shards are permuted, then the samples are shuffled within consecutive windows of `shuffle_buffer`
(a block shuffle: what a shuffle buffer of that size does, but planned, so it can be resumed and redistributed).
Each rank takes one contiguous block of that order; in training every rank gets the same number of samples, so
DDP ranks take the same number of steps, and the few left over (fewer than the world size) are left out of that
epoch, said once in the log. Validation and test take everything, ranks differing by at most one sample.

A DataLoader asks for batches by number, `(epoch, b)`, and any worker can make any of them, so the stream's
position is the loop's (`Progress.epoch`, `batch_in_epoch`) and the order does not depend on the number of workers:
a resume with another `num_workers` continues with exactly the samples not yet consumed, each once, in the same
order. A resume mid-epoch on another number of processes plans the rest of that epoch anew: every sample the old
ranks had not consumed (their blocks' tails, then what their plan left out), split over the new ranks as above,
its batches numbered so that the epoch ends where a whole epoch on the new ranks would (`Rest`).

How samples are read depends on the dataset:
- a source with `shard_sizes()` and `read(indices)` (random access by storage position, such as
  `framework.data.shards.TarShards`) reads just its batches' samples;
- any other IterableDataset is scanned from its start by every worker, which keeps its own samples (its size is
  its `len()`, else counted in one pass at setup; the shuffle is then the window shuffle alone, which a forward
  scan can serve with a buffer of about one window).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from framework.core.errors import ConfigError
from framework.core.reproducibility import generator, worker_seed

log = logging.getLogger(__name__)

_BRACES = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's shard lists: `train-{000000..000009}.tar` (zero-padded range) and `{a,b}` alternatives."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        first, last = numbers.groups()
        width = len(first) if first.startswith("0") else 0
        options = [str(i).zfill(width) for i in range(int(first), int(last) + 1)]
    else:
        options = body.split(",")
    return [name for option in options for name in expand_braces(head + option + tail)]


def epoch_order(sizes: Sequence[int], seed: int, epoch: int, shuffle: bool, window: int) -> torch.Tensor:
    """The storage positions of every sample in the order of `epoch`: shards permuted, then each window of
    `window` consecutive samples shuffled. Depends on (seed, epoch) only."""
    total = sum(sizes)
    if not shuffle:
        return torch.arange(total)
    g = generator(seed + epoch)
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    shards = torch.randperm(len(sizes), generator=g).tolist()
    order = torch.cat([torch.arange(starts[s], starts[s] + sizes[s]) for s in shards]) if shards else torch.arange(0)
    if window > 1:  # one sort: window number first, a random key within it
        keys = (
            torch.rand(total, generator=g, dtype=torch.float64)
            + torch.div(torch.arange(total), window, rounding_mode="floor").double()
        )
        order = order[torch.argsort(keys)]
    return order


def rank_block(total: int, rank: int, world_size: int, equal: bool) -> tuple[int, int]:
    """The [start, stop) of `rank`'s block of an epoch's order: equal blocks (the rest left out) or all of it."""
    if equal:
        per = total // world_size
        return rank * per, (rank + 1) * per
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def remaining(order: torch.Tensor, world_size: int, consumed: int) -> torch.Tensor:
    """What `world_size` ranks with equal blocks of `order` had not consumed after `consumed` samples each: the
    tail of each rank's block, in rank order, then what their plan left out."""
    per = len(order) // world_size
    done = min(consumed, per)
    tails = [order[r * per + done : (r + 1) * per] for r in range(world_size)]
    return torch.cat([*tails, order[world_size * per :]])


@dataclass
class Rest:
    """The rest of `epoch` after mid-epoch resumes on other numbers of processes: for each, (world size, samples
    each rank had consumed) applied to the epoch's order by `remaining`; the loop's batch numbers of the rest start
    at `offset`."""

    epoch: int
    chain: list[tuple[int, int]]
    offset: int


def stream_size(dataset: IterableDataset, split: str) -> list[int]:
    """The samples of each shard of a streaming dataset (one "shard" for a plain iterable)."""
    sizes = getattr(dataset, "shard_sizes", None)
    if callable(sizes):
        return [int(s) for s in sizes()]
    try:
        return [len(dataset)]  # type: ignore[arg-type]
    except TypeError:
        pass
    count = sum(1 for _ in dataset)
    log.info("data.%s: counted %d samples of %s in one pass (it has no len())", split, count, type(dataset).__name__)
    return [count]


class Bad:
    """What a source's `read` gives for a bad sample it skips (data.skip_corrupt): why. The stream warns once per
    sample and counts it, whichever process read it and however many epochs meet it."""

    def __init__(self, message: str) -> None:
        self.message = message


class Failed:
    """A worker's report of bad input, raised in the main process as one `Error:` line (a worker's own exception
    would arrive wrapped in its traceback)."""

    def __init__(self, message: str) -> None:
        self.message = message


class Scanner:
    """Random access to a forward-only iterable, for requests in ascending order: it scans on, keeping the
    samples at or after `floor` (which later requests may still ask for), and starts again from the beginning
    when asked for one it has passed (a new epoch, a resume)."""

    def __init__(self, dataset: Iterable, split: str) -> None:
        self.dataset, self.split = dataset, split
        self.it: Optional[Iterator[Any]] = None
        self.next, self.floor = 0, 0
        self.kept: dict[int, Any] = {}

    def read(self, positions: list[int], floor: int) -> list[Any]:
        if self.it is None or floor < self.floor or any(p < self.floor and p not in self.kept for p in positions):
            self.it, self.next, self.kept = iter(self.dataset), 0, {}
        self.floor = floor
        self.kept = {p: x for p, x in self.kept.items() if p >= floor}
        wanted = max(positions)
        while self.next <= wanted:
            sample = next(self.it, _END)
            if sample is _END:
                raise ConfigError(
                    f"data.{self.split}: {type(self.dataset).__name__} ended after {self.next} samples; expected "
                    f"at least {wanted + 1} (its size when the run started): the same stream every epoch"
                )
            if self.next >= floor:
                self.kept[self.next] = sample
            self.next += 1
        return [self.kept.pop(p) for p in positions]


_END = object()


class EpochBatches(Dataset):
    """Batch `(epoch, b)` of one rank's plan, read and collated where it is asked for (a DataLoader worker, or
    the main process): `(batch, [(position, why) of each bad sample skipped])`, or a `Failed`. Any worker can make
    any batch, so the order does not depend on the number of workers, and persistent workers follow the epochs."""

    def __init__(self, stream: "Stream") -> None:
        self.stream = stream
        self._epoch, self._order = -1, torch.arange(0)
        self._scanner: Optional[Scanner] = None

    def __len__(self) -> int:
        return self.stream.batches_n

    def __getitem__(self, index: tuple[int, int]) -> Any:
        epoch, b = index
        s = self.stream
        if epoch != self._epoch:
            self._epoch, self._order = epoch, s.order(epoch)
        first = b * s.batch_size
        positions = self._order[first : first + s.batch_size].tolist()
        try:
            if s.random_access:
                samples = list(getattr(s.dataset, "read")(positions))
            else:
                if self._scanner is None:
                    self._scanner = Scanner(s.dataset, s.split)
                samples = self._scanner.read(positions, s.floor(first))
        except ConfigError as err:
            return Failed(str(err))
        kept = [x for x in samples if not isinstance(x, Bad)]
        if not kept:
            return Failed(f"data.{s.split}: every sample of batch {b} of epoch {epoch} is bad; expected readable data")
        return s.collate(kept), [(p, x.message) for p, x in zip(positions, samples) if isinstance(x, Bad)]


class Stream:
    """One streaming split of one rank: its plan per epoch and its batches from any batch on."""

    def __init__(
        self,
        dataset: IterableDataset,
        split: str,
        *,
        batch_size: int,
        drop_last: bool,
        shuffle: bool,
        shuffle_buffer: int,
        seed: int,
        rank: int,
        world_size: int,
        collate_fn: Optional[Callable[[list], Any]],
        loader_options: dict[str, Any],
    ) -> None:
        self.dataset, self.split, self.batch_size, self.drop_last = dataset, split, batch_size, drop_last
        self.shuffle, self.window, self.seed = shuffle, max(1, shuffle_buffer), seed
        self.rank, self.world_size = rank, world_size
        self.collate = collate_fn or default_collate
        self.loader_options = loader_options
        self.sizes = stream_size(dataset, split)
        self.samples = sum(self.sizes)
        self.random_access = callable(getattr(dataset, "read", None)) and callable(
            getattr(dataset, "shard_sizes", None)
        )
        self.equal = split == "train"  # DDP ranks must take the same number of steps
        self.block = rank_block(self.samples, rank, world_size, self.equal)
        self.batches_n = self._count(self.block[1] - self.block[0])
        self.bad: set[int] = set()  # storage positions of the bad samples skipped so far (data.skip_corrupt)
        self.rest: Optional[Rest] = None
        left_out = self.samples - (self.block[1] - self.block[0]) * world_size if self.equal else 0
        if left_out and rank == 0:
            log.info(
                "data.%s: %d of %d samples are left out of each epoch (different ones each epoch when "
                "shuffled) so that %d ranks take equal steps",
                split,
                left_out,
                self.samples,
                world_size,
            )
        self._next: tuple[int, int] = (0, 0)  # the epoch and first batch the loader's next pass serves
        self._loader: Optional[DataLoader] = None

    def _count(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's storage positions for `epoch` (or for the rest of it, after a resume on other ranks)."""
        sizes = self.sizes if self.random_access else [self.samples]  # a scan: the window shuffle alone
        order = epoch_order(sizes, self.seed, epoch, self.shuffle, self.window)
        if self.rest is not None and self.rest.epoch == epoch:
            for world_size, consumed in self.rest.chain:
                order = remaining(order, world_size, consumed)
            start, stop = rank_block(len(order), self.rank, self.world_size, self.equal)
            return order[start:stop]
        return order[self.block[0] : self.block[1]]

    def offset(self, epoch: int) -> int:
        """The loop's number of the first batch of `order(epoch)`."""
        return self.rest.offset if self.rest is not None and self.rest.epoch == epoch else 0

    def redistribute(self, epoch: int, chain: list[tuple[int, int]]) -> int:
        """Plan the rest of `epoch` after `chain` (see Rest); returns the loop's batch it starts at."""
        planned = Rest(epoch, chain, 0)
        self.rest = planned
        offset = max(0, self.batches_n - self._count(len(self.order(epoch))))  # (order() reads the plan's chain)
        self.rest = Rest(epoch, chain, offset)
        return offset

    def floor(self, first: int) -> int:
        """The lowest storage position that batches from `first` (in this rank's order) on may need, for a scan."""
        start = self.block[0] + first
        return start // self.window * self.window if self.shuffle else start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The loader's sampler: `(epoch, batch)` from the set start on."""
        epoch, start = self._next
        offset = self.offset(epoch)
        return iter([(epoch, b) for b in range(start - offset, self.batches_n - offset)])

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The batches of `epoch` from batch `start` on; bad input is one ConfigError, raised here."""
        if self._loader is None:
            self._loader = DataLoader(
                EpochBatches(self), batch_size=None, sampler=self, generator=generator(0), **self.loader_options
            )
        self._next = (epoch, start)
        # worker seeds follow the epoch, not global RNG, and the rank (as for map-style splits)
        cast(torch.Generator, self._loader.generator).manual_seed(worker_seed(self.seed, epoch, self.rank))
        for made in self._loader:
            if isinstance(made, Failed):
                raise ConfigError(made.message)
            batch, bad = made
            for position, why in bad:
                if position not in self.bad:
                    self.bad.add(position)
                    log.warning("%s: skipped (data.skip_corrupt=true)", why)
            yield batch

    def close(self) -> None:
        """Let its (persistent) workers go: the next pass starts new ones."""
        self._loader = None

    def __getstate__(self) -> dict[str, Any]:  # what a worker gets: the plan, not the loader
        return {**self.__dict__, "_loader": None}


class StreamState:
    """The streams as registered resumable state. Their position is the loop's (epoch, batch_in_epoch), which the
    plan turns into samples; saved here is what that needs (each split's size, the world size and batch size of
    the plan, a redistributed rest of the epoch) and the bad samples skipped so far. A resume on other data is
    refused (here by its size, for checkpoints older than the data's identity: framework/data/module.py); one mid-epoch
    on another number of processes gets the rest of the epoch redistributed (`Rest`), and sets the loop's batch in the
    epoch to where that rest starts. `new_data`: the splits a resume on new data (resume_on_new_data) takes as they
    are now, whose saved state describes other samples: neither held against them nor loaded."""

    def __init__(self, streams: dict[str, Stream], progress: Any, new_data: Collection[str] = ()) -> None:
        self.streams, self.progress, self.new_data = streams, progress, new_data

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            split: {"samples": s.samples, "world_size": s.world_size, "bad": sorted(s.bad)}
            for split, s in self.streams.items()
        }
        train = self.streams.get("train")
        if train is not None:
            p, rest = self.progress, train.rest
            current = rest is not None and rest.epoch == p.epoch
            state["train"].update(
                epoch=p.epoch,
                batch_in_epoch=p.batch_in_epoch,
                batch_size=train.batch_size,
                chain=[list(link) for link in rest.chain] if rest is not None and current else [],
                offset=rest.offset if rest is not None and current else 0,
            )
        return state

    def check_state_dict(self, saved: Any, where: str) -> None:
        for split, s in self.streams.items():
            was = saved.get(split) if isinstance(saved, dict) else None
            if not isinstance(was, dict) or split in self.new_data:
                continue  # a split that was not a stream then, or that a resume takes anew: nothing to hold it to
            if was.get("samples") != s.samples:
                raise ConfigError(
                    f"data.{split}: {s.samples} samples now, {was.get('samples')} when {where.split(':')[0]} was "
                    "saved; expected the same data to resume the same order"
                )
            moved = was.get("world_size") != s.world_size and was.get("batch_in_epoch", 0) > 0
            if split == "train" and moved and not s.random_access:
                raise ConfigError(
                    f"data.train: {where.split(':')[0]} was saved mid-epoch on {was.get('world_size')} processes, "
                    f"this run has {s.world_size}, and {type(s.dataset).__name__} is read by a scan; expected the "
                    "same number (or a checkpoint from an epoch's end, or a source with shard_sizes() and read())"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for split, s in self.streams.items():
            if split not in self.new_data:
                s.bad = set(state.get(split, {}).get("bad", []))
        train, saved = self.streams.get("train"), state.get("train", {})
        if train is None or "epoch" not in saved or "train" in self.new_data:
            return
        chain = [(int(w), int(c)) for w, c in saved["chain"]]
        k, offset = saved["batch_in_epoch"], saved["offset"]
        if saved["world_size"] == train.world_size:
            if chain:
                train.rest = Rest(saved["epoch"], chain, offset)
            return
        if k == 0:  # an epoch's end: the next one is planned for the new world size
            return
        consumed = (k - offset) * saved["batch_size"]
        self.progress.resume_at_batch(train.redistribute(saved["epoch"], [*chain, (saved["world_size"], consumed)]))
        if train.rank == 0:
            log.info(
                "data.train: saved mid-epoch %d on %d processes, resumed on %d: the rest of the epoch, %d samples a "
                "process, starts at batch %d of %d",
                saved["epoch"],
                saved["world_size"],
                train.world_size,
                len(train.order(saved["epoch"])),
                self.progress.batch_in_epoch,
                train.batches_n,
            )
