"""Checking training checkpoints before a resume, and choosing the newest intact one to resume from.

The cheap check runs at every resume, the full one in ``zcpo checkpoint verify`` (what each covers,
and why: :mod:`megatron_zcpo.checkpoint.manifest`). A damaged checkpoint is never deleted:
it is renamed to ``step_XXXXXXXX.damaged``, out of reach of resumes, re-saves and ``keep_last``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_zcpo.checkpoint.io import (
    DAMAGED_SUFFIX,
    TRAINER_STATE,
    list_checkpoints,
    read_checkpoint_file,
)
from megatron_zcpo.checkpoint.manifest import CheckpointDamagedError, check_files, read_manifest


def verify_checkpoint(path: str | os.PathLike, *, full: bool = False) -> Dict[str, Any]:
    """Check a training checkpoint without loading it into a model; no process group needed.

    Always (cheap: metadata and sizes): the manifest's files with their sizes, the checkpoint
    library's index of ``weights/`` (every byte range it reads lies inside its file) and, for a
    checkpoint written before manifests, that ``trainer_state.pt`` reads. With ``full`` also every
    file's checksum and every state file read back. Returns ``{"step", "run_id", "files", "bytes",
    "manifest"}`` (``manifest`` False for the old format); raises :class:`CheckpointDamagedError`
    naming the file.
    """
    path = Path(path)
    manifest = read_manifest(path)
    total = check_files(path, manifest, full=full)
    state = None
    if manifest is None or full:
        if not (path / TRAINER_STATE).is_file():
            raise CheckpointDamagedError(path, TRAINER_STATE, "missing")
        state = read_checkpoint_file(path, TRAINER_STATE)
    if full:
        for rng_file in sorted((path / "rng").glob("rank_*.pt")):
            read_checkpoint_file(path, rng_file.relative_to(path).as_posix())
    record = manifest or {"step": state.get("step"), "run_id": state.get("run_id"), "files": {}}
    return {
        "step": record.get("step"),
        "run_id": record.get("run_id"),
        "files": len(record["files"]),
        "bytes": total,
        "manifest": manifest is not None,
    }


def move_aside_damaged(checkpoint: Path) -> Optional[Path]:
    """Rename a damaged checkpoint to ``step_XXXXXXXX.damaged`` (``.damaged-2``, ...) so no resume
    picks it and no save or pruning deletes it; returns the new path (None when it cannot be renamed)."""
    target = checkpoint.with_name(checkpoint.name + DAMAGED_SUFFIX)
    count = 1
    while target.exists():
        count += 1
        target = checkpoint.with_name(f"{checkpoint.name}{DAMAGED_SUFFIX}-{count}")
    try:
        os.replace(checkpoint, target)
    except OSError:
        return None
    return target


def newest_intact_checkpoint(root: str | os.PathLike, warn) -> Optional[Path]:
    """The newest checkpoint under ``root`` that passes the quick :func:`verify_checkpoint`, or None.

    Each damaged one newer than it is moved aside (:func:`move_aside_damaged`, never deleted) and
    reported through ``warn(message)``, naming the file and the checkpoint resumed instead.
    """
    damaged = []
    for candidate in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(candidate)
        except CheckpointDamagedError as error:
            moved = move_aside_damaged(candidate)
            damaged.append(
                f"{error}. It was moved aside to {moved.name} (kept, not deleted)"
                if moved
                else f"{error}. It could not be moved aside (left in place)"
            )
            continue
        for message in damaged:
            warn(f"{message}; resuming from {candidate.name} instead, the newest intact checkpoint")
        return candidate
    for message in damaged:
        warn(f"{message}; no intact checkpoint is left under {root}")
    return None
