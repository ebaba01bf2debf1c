"""Run directories and run ids: each run directory holds one run, and a run never resumes another's checkpoint.

``<logging.run_dir>/run_id`` names the run that directory holds; its checkpoints (manifest and
trainer state) and every ``metrics.jsonl`` record carry the same id. :func:`open_run` is called
twice, with the same answer: by ``zcpo train`` before any process starts (so mistakes are
answered early and ``--overwrite`` clears the old run once), and by rank 0 of the run itself.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from megatron_zcpo.utils.config_loader import ConfigError

RUN_ID_FILE = "run_id"
METRICS_FILE = "metrics.jsonl"
# What a run writes into its run directory besides checkpoints (removed by --overwrite).
RUN_OUTPUTS = (METRICS_FILE, "eval", "tensorboard", "config.yaml", RUN_ID_FILE)


class RunMixError(ConfigError):
    """The run would mix with another one (overwrite it, or resume another run's checkpoint)."""


def read_run_id(run_dir: str | Path) -> Optional[str]:
    """The run id recorded in ``run_dir``, or None."""
    path = Path(run_dir) / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


def new_run_id() -> str:
    """A fresh run id: the start time and 8 random hex digits, e.g. ``20261204-181530-3f9a0c1e``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def checkpoint_run_id(checkpoint: Path) -> Optional[str]:
    """The run id a checkpoint records (its manifest, else its trainer state); None when it has none."""
    from megatron_zcpo.checkpoint.io import TRAINER_STATE, read_checkpoint_file
    from megatron_zcpo.checkpoint.manifest import read_manifest

    manifest = read_manifest(checkpoint)
    if manifest is not None:
        return manifest.get("run_id")
    return read_checkpoint_file(checkpoint, TRAINER_STATE).get("run_id")


def held_run(config) -> List[str]:
    """What ``config``'s run directory already holds of a run (metrics, checkpoints): [] when nothing.

    A run id alone is no run yet (the start of this very run, or one that died before its first step)."""
    from megatron_zcpo.checkpoint.io import STEP_PREFIX

    run_dir = Path(config.logging.run_dir)
    held = []
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        with open(metrics) as records:
            held.append(f"{METRICS_FILE} ({sum(1 for _ in records)} records)")
    checkpoints = sorted(p.name for p in config.checkpoint_dir.glob(f"{STEP_PREFIX}*") if p.is_dir())
    if checkpoints:
        held.append(f"checkpoints {', '.join(checkpoints)} in {config.checkpoint_dir}")
    return held


def remove_run(config) -> None:
    """Delete the run in ``config``'s run directory (``--overwrite``): its outputs and its checkpoints
    (damaged checkpoints moved aside by a resume, ``*.damaged``, are left alone)."""
    from megatron_zcpo.checkpoint.io import DAMAGED_SUFFIX, LATEST, STEP_PREFIX

    run_dir = Path(config.logging.run_dir)
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for path in config.checkpoint_dir.glob(f"{STEP_PREFIX}*"):
        if DAMAGED_SUFFIX not in path.name:
            shutil.rmtree(path)
    (config.checkpoint_dir / LATEST).unlink(missing_ok=True)


def open_run(config, warn: Callable[[str], None], *, overwrite: bool = False) -> Tuple[Optional[Path], str]:
    """(checkpoint to resume from or None, run id) of ``config``; records the run id in the run directory.

    ``checkpoint.resume=never`` into a run directory that holds a run is refused unless ``overwrite``
    (which deletes that run first). ``auto`` takes the newest intact checkpoint (a damaged newer one
    is named through ``warn`` and moved aside, see megatron_zcpo/checkpoint/verify.py); a
    path must be intact. A checkpoint of another run id than the run directory's is refused.
    Raises :class:`RunMixError` or :class:`~megatron_zcpo.checkpoint.manifest.CheckpointDamagedError`.
    """
    from megatron_zcpo.checkpoint.verify import newest_intact_checkpoint, verify_checkpoint

    run_dir, resume = Path(config.logging.run_dir), config.checkpoint.resume
    if overwrite and resume not in ("auto", "never"):
        raise RunMixError(f"--overwrite starts a new run; it cannot resume checkpoint.resume={resume}")
    held = held_run(config)
    if held and overwrite:
        warn(f"--overwrite: deleting the run in {run_dir} ({'; '.join(held)})")
        remove_run(config)
    elif held and resume == "never":
        raise RunMixError(
            f"logging.run_dir={run_dir} already holds run {read_run_id(run_dir) or '(no id)'}: {'; '.join(held)}. "
            "checkpoint.resume=never would write a second run over it. Continue it with checkpoint.resume=auto, "
            "start the new run in another logging.run_dir, or pass --overwrite to delete the old run"
        )
    checkpoint = None
    if resume == "auto":
        checkpoint = newest_intact_checkpoint(config.checkpoint_dir, warn)
    elif resume != "never":
        checkpoint = Path(resume)
        verify_checkpoint(checkpoint)
    run_id = read_run_id(run_dir)
    if checkpoint is not None:
        theirs = checkpoint_run_id(checkpoint)
        if run_id and theirs and theirs != run_id:
            raise RunMixError(
                f"checkpoint {checkpoint} belongs to run {theirs}, but logging.run_dir={run_dir} holds run {run_id}: "
                f"runs never mix. To continue run {theirs}, set logging.run_dir to its directory; to start a new run "
                f"from its weights, set model.path={checkpoint / 'weights'} and checkpoint.resume=never in a new "
                "logging.run_dir"
            )
        run_id = run_id or theirs
    run_id = run_id or new_run_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    if read_run_id(run_dir) != run_id:
        (run_dir / RUN_ID_FILE).write_text(run_id + "\n")
    return checkpoint, run_id
