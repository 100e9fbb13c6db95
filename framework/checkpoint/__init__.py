"""Checkpoints: a pickle-free format, atomic writes, save policies and resume discovery.

A checkpoint is a directory of `model.safetensors` (the model's weights), `state.safetensors` (every tensor of
the training state) and `meta.json` (counters, metrics, the config, the state's structure, checksums). It is
written atomically, so a crash mid-save never damages an existing checkpoint, and read from JSON and
safetensors only, so it cannot run code; whatever a checkpoint directory holds, reading it ends in one
`DamagedCheckpoint` line naming the file. A sharded run (parallel=fsdp) writes a model and a state file per
rank instead, each rank its own shards, read back on any number of ranks. The package knows nothing of what
the state means: the trainer hands it plain nested dicts of tensors (DTensors too) and primitives (what
`state_dict()` methods return) and gets the same back.

- `format`: file names, versions, errors, flatten/unflatten, checksums;
- `save`: atomic writes and links; `sharded`: a sharded run's saves, every rank writing its own files;
- `load`: reading and verifying a checkpoint (`open_checkpoint`), plain or sharded;
- `writer`: inline or background saves (`async_save`);
- `policies`: when to save and what to keep (`CheckpointManager`);
- `discovery`: the newest intact checkpoint of a run (`find_latest`);
- `validation`: a loaded state checked against the live components before any of it is loaded;
- `weights`: foreign weights for `init_from` and export.
"""

from framework.checkpoint.discovery import find_latest
from framework.checkpoint.format import (
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointSaveError,
    DamagedCheckpoint,
    UnreadableCheckpoint,
    digest,
)
from framework.checkpoint.load import MAX_META_BYTES, Checkpoint, open_checkpoint
from framework.checkpoint.policies import CheckpointManager
from framework.checkpoint.save import link_checkpoint, write_checkpoint
from framework.checkpoint.sharded import link_sharded, write_sharded
from framework.checkpoint.validation import validate_rng_state, validate_state
from framework.checkpoint.weights import check_compatible, load_weights
from framework.checkpoint.writer import CheckpointWriter

__all__ = [
    "MAX_META_BYTES",
    "META_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointWriter",
    "DamagedCheckpoint",
    "UnreadableCheckpoint",
    "check_compatible",
    "digest",
    "find_latest",
    "link_checkpoint",
    "link_sharded",
    "load_weights",
    "open_checkpoint",
    "validate_rng_state",
    "validate_state",
    "write_checkpoint",
    "write_sharded",
]
