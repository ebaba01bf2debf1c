"""Megatron checkpoints: model weights at any TP/PP, and atomic, resumable training checkpoints.

A *model checkpoint* is a megatron-core dist_checkpointing (torch_dist) directory of a GPTModel's
sharded state dict plus ``model_config.json`` (the :class:`ModelConfig`); it loads at any TP/PP
(:func:`load_model_checkpoint`). The converter (megatron_zcpo.convert) writes these from Hugging
Face weights, and every training checkpoint's ``weights/`` is one too (its optimizer state rides
along under its own keys), so a trained policy converts back or seeds another run directly.

Layout of one training checkpoint (``<root>/step_00000010``):
- ``weights/``: dist_checkpointing of ``{"model", "optimizer"}`` and ``model_config.json``,
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
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.megatron.platform import has_cuda
from megatron_zcpo.utils.runtime import unwrap

STEP_PREFIX = "step_"
LATEST = "latest"
MODEL_CONFIG_FILE = "model_config.json"
# Training choices that do not change what the weights mean; a loading run may differ in them.
NON_ARCHITECTURE_FIELDS = ("init_method_std", "make_vocab_size_divisible_by")
# TE modules keep FP8 scaling state here; converted weights carry none, so loading keeps the model's.
_EXTRA_STATE_SUFFIX = "_extra_state"


class CheckpointMismatchError(ValueError):
    """The checkpoint holds another model; the message names the differing fields."""


# ----------------------------------------------------------------------------- model checkpoints


def write_model_config(ckpt_dir: str | os.PathLike, model: ModelConfig) -> None:
    """Store ``model`` as ``ckpt_dir/model_config.json``."""
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(ckpt_dir) / MODEL_CONFIG_FILE, "w") as handle:
        json.dump(model.to_dict(), handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_model_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` stored in a model checkpoint directory.

    Raises ``FileNotFoundError`` when ``ckpt_dir`` has no ``model_config.json`` and ``ValueError``
    naming unknown fields.
    """
    path = Path(ckpt_dir) / MODEL_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {ckpt_dir} is not a megatron_zcpo model checkpoint")
    with open(path) as handle:
        fields = json.load(handle)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(f"{path}: unknown ModelConfig field(s) {unknown}")
    model = ModelConfig(**fields)
    model.validate(prefix=str(path))
    return model


def check_same_architecture(stored: ModelConfig, model: ModelConfig, ckpt_dir: str | os.PathLike) -> None:
    """Raise :class:`CheckpointMismatchError` naming every architecture field where they differ."""
    stored_fields, model_fields = stored.to_dict(), model.to_dict()
    differing = [f"{key}: checkpoint {stored_fields[key]!r} vs run {model_fields[key]!r}"
                 for key in stored_fields
                 if key not in NON_ARCHITECTURE_FIELDS and stored_fields[key] != model_fields[key]]
    if differing:
        raise CheckpointMismatchError(f"checkpoint {ckpt_dir} holds another model: " + "; ".join(differing))


def load_model_checkpoint(model_chunks, ckpt_dir: str | os.PathLike) -> None:
    """Load a model checkpoint into this rank's GPTModel chunk(s), at any TP/PP.

    ``model_chunks``: a GPTModel from :func:`build_gpt_model` (DDP/Float16 wrappers allowed) or
    a list of them. Uses megatron-core's ``dist_checkpointing.load`` with the model's own sharded
    state dict; TE FP8 ``_extra_state`` is left as initialised. Call it before building an
    optimizer (which copies the parameters). Raises :class:`CheckpointMismatchError` naming the
    differing fields when the checkpoint holds another architecture, ``KeyError`` naming a
    missing tensor. Collective over all ranks.
    """
    from megatron.core import dist_checkpointing

    chunks = [unwrap(chunk) for chunk in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    stored_model = read_model_config(ckpt_dir)
    for chunk in chunks:
        check_same_architecture(stored_model, chunk.zcpo_model_config, ckpt_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    request = {}
    for index, chunk in enumerate(chunks):
        state = {name: value for name, value in chunk.sharded_state_dict().items()
                 if not name.endswith(_EXTRA_STATE_SUFFIX)}
        for name, value in state.items():
            key = getattr(value, "key", None)
            if key is not None and key not in stored:
                raise KeyError(f"checkpoint {ckpt_dir} has no tensor {key!r} (model parameter {name!r})")
        request[index] = state
    loaded = dist_checkpointing.load(request, str(ckpt_dir))
    for index, chunk in enumerate(chunks):
        missing, unexpected = chunk.load_state_dict(loaded[index], strict=False)
        missing = [name for name in missing if not name.endswith(_EXTRA_STATE_SUFFIX)]
        if missing or unexpected:
            raise KeyError(f"loading {ckpt_dir}: missing {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------- training checkpoints


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
    if has_cuda():
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
    if "cuda" in state and has_cuda():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model, optimizer, is_loading: bool) -> Dict[str, Any]:
    model_state = unwrap(model).sharded_state_dict()
    # fully_reshardable: loadable at any DP size (and the only distributed-optimizer format
    # that saves without CUDA); ignored by the plain optimizer.
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)}


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

    ``trainer_state`` holds the picklable loop state (stored as given, plus the step). The
    model's :class:`ModelConfig` is written beside the weights. Returns the checkpoint directory.
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
    if rank == 0:
        write_model_config(tmp / "weights", unwrap(model).zcpo_model_config)
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


def load_checkpoint(path: str | os.PathLike, model, optimizer) -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    The stored model config is compared with the model's first (:class:`CheckpointMismatchError`
    naming the differing fields). RNG states are restored when the world size matches. Returns
    the trainer state dict. Collective over all ranks.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(path)
    state_file = path / "trainer_state.pt"
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.pt)")
    check_same_architecture(read_model_config(path / "weights"), unwrap(model).zcpo_model_config, path)
    trainer_state = torch.load(state_file, weights_only=False)
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path / "weights"))
    unwrap(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if trainer_state.get("world_size") == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state
