"""k-fold cross-validation (framework/data/folds.py, issue 34): `data.folds=K data.fold=i` cuts data.train into K seeded,
stratified folds, fold i the val split; the fold's samples are kept in folds.json; a sweep over data.fold gets a
mean ± std row per setting of the other swept keys in summary.csv; bad input is one line."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import output, run_cli
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from framework.core.errors import ConfigError
from framework.data import folds
from framework.data.module import DataModule, TensorBatches

pytestmark = pytest.mark.unit


def labelled(counts: list[int]) -> TensorDataset:
    """counts[c] samples of class c; each sample's input is its own index."""
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    return TensorDataset(torch.arange(len(y)).float().unsqueeze(1), y)


class Samples(Dataset):
    """A map-style dataset with no `targets` and no tensors: labels are read sample by sample."""

    def __init__(self, labels: list) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.zeros(1), self.labels[i]


def test_the_folds_partition_the_train_split_each_class_in_proportion_and_sizes_within_one():
    data = labelled([23, 7, 40])
    classes = folds.labels(data, len(data))
    made = [folds.split(70, 5, i, seed=3, classes=classes) for i in range(5)]
    vals = torch.cat([m.val for m in made])
    assert torch.equal(vals.sort().values, torch.arange(70))  # every sample validated on exactly once
    for m in made:
        assert torch.equal(torch.cat([m.train, m.val]).sort().values, torch.arange(70))  # disjoint, complete
        per_class = torch.bincount(classes[m.val], minlength=3)
        assert all(abs(int(per_class[c]) - n / 5) < 1 for c, n in enumerate([23, 7, 40])), per_class
        assert m.stratified
    assert max(len(m.val) for m in made) - min(len(m.val) for m in made) <= 1


def test_the_folds_follow_the_seed_and_only_the_seed():
    classes = folds.labels(labelled([30, 30]), 60)
    a, b = folds.split(60, 3, 1, seed=7, classes=classes), folds.split(60, 3, 1, seed=7, classes=classes)
    assert torch.equal(a.val, b.val)
    assert not torch.equal(a.val, folds.split(60, 3, 1, seed=8, classes=classes).val)
    unstratified = folds.split(60, 3, 1, seed=7, classes=None)
    assert len(unstratified.val) == 20 and not unstratified.stratified


def test_labels_come_from_tensors_targets_a_subset_or_each_sample_and_are_none_without_a_class():
    class Targets(Samples):
        def __init__(self, labels: list) -> None:
            super().__init__(labels)
            self.targets = labels

    assert folds.labels(labelled([2, 1]), 3).tolist() == [0, 0, 1]
    assert folds.labels(Targets([4, 2, 9]), 3).tolist() == [4, 2, 9]
    assert folds.labels(Subset(Targets([4, 2, 9]), [2, 0]), 2).tolist() == [9, 4]
    assert folds.labels(Samples([1, torch.tensor(3)]), 2).tolist() == [1, 3]
    assert folds.labels(Samples([0.5, 1.5]), 2) is None  # regression targets: not stratified
    assert folds.labels(TensorDataset(torch.zeros(3, 2)), 3) is None  # inputs only


@pytest.mark.parametrize(
    "folds_, fold, said",
    [
        (5, 5, "data.fold=5: expected the validation fold, a whole number in 0..4 (data.folds=5)"),
        (1, 0, "data.folds=1: expected null (no cross-validation) or a whole number of folds >= 2"),
        (None, 2, "data.fold=2: data.folds is null; expected data.folds=K"),
        (3, None, "data.fold=null: expected the validation fold, a whole number in 0..2"),
    ],
)
def test_a_bad_fold_or_number_of_folds_is_one_line_naming_the_key(folds_, fold, said):
    with pytest.raises(ConfigError, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        DataModule(labelled([5, 5]), folds=folds_, fold=fold)


def test_a_class_with_fewer_samples_than_folds_and_a_stream_are_refused_in_one_line():
    data = DataModule(labelled([10, 2]), num_classes=2, folds=3, fold=0)
    with pytest.raises(ConfigError, match=r"^data.folds=3: class 1 of data.train has 2 sample\(s\), fewer than the 3 "
                                          r"folds.*expected data.folds <= 2$"):
        data.setup(seed=0)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match=r"^data.folds=3: data.train is Stream, a stream.*expected a map-style"):
        DataModule(Stream(), folds=3, fold=0).setup(seed=0)


def test_the_datamodule_validates_on_the_fold_trains_on_the_rest_and_leaves_test_alone():
    train, test = labelled([12, 8]), labelled([3])
    data = DataModule(train, labelled([99]), test, num_classes=2, batch_size=4, folds=4, fold=2)
    data.setup(seed=5)
    made = data.fold_split
    assert made is not None and made.stratified
    val_inputs = torch.cat([x for x, _ in data.batches("val")]).squeeze(1).long()
    train_inputs = torch.cat([x for x, _ in data.batches("train")]).squeeze(1).long()
    assert sorted(val_inputs.tolist()) == made.val.tolist() and len(val_inputs) == 5
    assert sorted(train_inputs.tolist()) == made.train.tolist()
    assert data.datasets["test"] is test
    assert isinstance(data._loaders["train"][1], TensorBatches)  # tensors keep the in-memory fast path
    data.setup(seed=5)  # set up again (a second build): the same fold, not a fold of the fold
    assert len(data.datasets["train"]) == 15
    plain = DataModule(Samples([0, 1] * 6), num_classes=2, batch_size=4, folds=3, fold=0)
    plain.setup(seed=0)  # a dataset of samples: a Subset through the DataLoader
    assert isinstance(plain.datasets["val"], Subset) and len(plain.datasets["val"]) == 4


def test_the_record_is_written_once_and_a_run_continued_on_other_samples_is_refused(tmp_path):
    classes = folds.labels(labelled([6, 6]), 12)
    made = folds.split(12, 3, 1, seed=0, classes=classes)
    folds.write_record(made, tmp_path)
    record = json.loads((tmp_path / folds.RECORD).read_text())
    assert record == {"folds": 3, "fold": 1, "seed": 0, "stratified": True, "train": made.train.tolist(),
                      "val": made.val.tolist()}
    folds.write_record(folds.split(12, 3, 1, seed=0, classes=classes), tmp_path)  # the same fold: kept
    with pytest.raises(ConfigError, match=r"^data.fold=2: .*folds.json records the samples this run started with "
                                          r"\(folds=3, fold=1, seed=0\)"):
        folds.write_record(folds.split(12, 3, 2, seed=0, classes=classes), tmp_path)


def _job(sweep_dir: Path, name: str, overrides: list[str], summary: dict) -> None:
    (sweep_dir / name / ".hydra").mkdir(parents=True)
    (sweep_dir / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (sweep_dir / name / "summary.json").write_text(json.dumps(summary))


def test_a_sweep_over_lr_and_fold_gets_one_mean_and_std_row_per_lr(tmp_path, capsys):
    from omegaconf import OmegaConf

    from framework.app.sweep import FOLDS_ROW, report

    accs = {"0.1": [0.9, 0.8, 0.7], "0.5": [0.95, 0.97, None], "0.9": [0.5]}  # None: failed; 0.9: folds 1, 2 to run
    n = 0
    for lr, values in accs.items():
        for fold, acc in enumerate(values):
            record = {"val/acc": acc, "seconds": 1.0, "status": "ok"} if acc else {"status": "failed", "error": "x"}
            _job(tmp_path, f"{n}_lr={lr},fold={fold}", ["data.folds=3", f"optimizer.lr={lr}", f"data.fold={fold}"],
                 record)
            n += 1
    config = OmegaConf.create({"checkpoint": {"monitor": "val/acc", "mode": "max"}})
    assert report(config, tmp_path, {"optimizer.lr", "data.fold"}) is True  # a fold failed: the sweep did too
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    means = [row for row in table if row["job"] == FOLDS_ROW]
    assert [(r["optimizer.lr"], r["data.fold"], r["val/acc"], r["status"]) for r in means] == [
        ("0.5", "2 of 3 folds", "0.9600 ± 0.0141", "incomplete"),
        ("0.1", "3 of 3 folds", "0.8000 ± 0.1000", "ok"),
        ("0.9", "1 of 3 folds", "0.5000 ± 0.0000", "incomplete"),
    ]
    assert means[0]["error"] == "fold 2 failed" and means[1]["seconds"] == "3.0" and means[1]["error"] == ""
    assert means[2]["error"] == "fold 1 missing, fold 2 missing"
    assert table[:7] == [r for r in table if r["job"] != FOLDS_ROW]  # the jobs first, as before
    out = capsys.readouterr().out
    assert "Sweep summary (7 jobs" in out and f"{FOLDS_ROW}  0.1" in out


@pytest.mark.e2e
def test_a_fold_sweep_runs_each_fold_as_a_job_records_its_samples_and_summarises_them(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(None, "-m", f"hydra.sweep.dir={sweep_dir}", "logger.progress_bar=false", "trainer.max_epochs=1",
                   "trainer.limit_train_batches=2", "checkpoint=none", "trainer.test=false", "data.folds=2",
                   "data.fold=range(2)", fast=False)
    assert proc.returncode == 0, output(proc)
    records = [json.loads((sweep_dir / f"{i}_data.fold={i}" / folds.RECORD).read_text()) for i in range(2)]
    assert sorted(i for r in records for i in r["val"]) == list(range(1257))  # digits' train split, each once
    assert all(r["train"] == sorted(set(range(1257)) - set(r["val"])) for r in records)
    with open(sweep_dir / "summary.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert last["data.fold"] == "2 of 2 folds" and " ± " in last["val/acc"] and last["status"] == "ok"
