"""Training checkpoints: dist_checkpointing model + optimizer, trainer state, atomic and resumable.

Layout of one checkpoint (``<root>/step_00000010``):
- ``weights/``: megatron-core dist_checkpointing (torch_dist) of ``{"model", "optimizer"}``,
  reshardable to another TP/PP/DP (the distributed optimizer is saved fully reshardable);
- ``trainer_state.pt``: step, LR scheduler, data position, anything the loop adds, the run
  config and the model config (written by global rank 0);
- ``rng/rank_XXXXX.pt``: every rank's generator states (restored when the world size matches).
Every rank writes into ``step_00000010.tmp``; after a barrier rank 0 renames it and then points
``<root>/latest`` at it (write + rename), so a crash leaves either the old or the new checkpoint,
never half of one. ``keep_last`` checkpoints are kept.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

STEP_PREFIX = "step_"
LATEST = "latest"


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model; the message names the differing fields."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> List[Path]:
    """Complete checkpoints under ``root`` (renamed, with trainer state), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and not p.name.endswith(".tmp") and (p / "trainer_state.pt").is_file()]
    return sorted(found, key=lambda p: p.name)


def find_latest(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (``latest`` pointer first), or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "trainer_state.pt").is_file():
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def _rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model, optimizer, is_loading: bool) -> Dict[str, Any]:
    from megatron_zcpo.megatron.pipeline import unwrap

    model_state = unwrap(model).sharded_state_dict()
    # fully_reshardable: loadable at any DP size (and the only distributed-optimizer format
    # that saves without CUDA); ignored by the plain optimizer.
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)}


def check_model_config(saved: Dict[str, Any], current) -> None:
    """Raise :class:`CheckpointMismatchError` naming every field where the model configs differ."""
    current_dict = dataclasses.asdict(current)
    differing = [f"{key}: checkpoint {saved.get(key)!r} vs run {current_dict.get(key)!r}"
                 for key in sorted(set(saved) | set(current_dict)) if saved.get(key) != current_dict.get(key)]
    if differing:
        raise CheckpointMismatchError("checkpoint was written for another model: " + "; ".join(differing))


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model,
    optimizer,
    trainer_state: Dict[str, Any],
    *,
    keep_last: int = 2,
) -> Path:
    """Save everything needed to resume at ``step``; collective over all ranks.

    ``trainer_state`` must hold the picklable loop state (it is stored as given, plus the step)
    and should carry ``model_config`` (a dict) for :func:`check_model_config`. Returns the
    checkpoint directory.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "weights").mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp / "weights"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        torch.save({**trainer_state, "step": step, "world_size": dist.get_world_size()}, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = Path(root) / (LATEST + ".tmp")
        pointer.write_text(final.name)
        os.replace(pointer, Path(root) / LATEST)
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model, optimizer, model_config=None) -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    The model config stored in the checkpoint is compared with ``model_config`` first (clear
    error naming the differing fields). RNG states are restored when the world size matches.
    Returns the trainer state dict. Collective over all ranks.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_zcpo.megatron.pipeline import unwrap

    path = Path(path)
    state_file = path / "trainer_state.pt"
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.pt)")
    trainer_state = torch.load(state_file, weights_only=False)
    if model_config is not None and "model_config" in trainer_state:
        check_model_config(trainer_state["model_config"], model_config)
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path / "weights"))
    unwrap(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if trainer_state.get("world_size") == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state
