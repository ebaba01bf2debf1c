"""Megatron checkpoints: model weights at any TP/PP, and atomic, resumable training checkpoints.

A *model checkpoint* is a megatron-core dist_checkpointing (torch_dist) directory of a GPTModel's
sharded state dict plus ``model_config.json`` (the :class:`ModelConfig`); it loads at any TP/PP
(:func:`load_model_checkpoint`). The converter (megatron_zcpo.convert) writes these from Hugging
Face weights, and every training checkpoint's ``weights/`` is one too (its optimizer state rides
along under its own keys), so a trained policy converts back or seeds another run directly.

Layout of one training checkpoint (``<root>/step_00000010``):
- ``weights/``: dist_checkpointing of ``{"model", "optimizer"}`` and ``model_config.json``,
  reshardable to another TP/PP/DP (the distributed optimizer is saved fully reshardable);
- ``trainer_state.pt``: step, LR scheduler, data position and anything the loop adds, as tensors
  and plain values (written by global rank 0, last);
- ``rng/rank_XXXXX.pt``: every rank's generator states as tensors and plain values (restored when
  the world size matches).
- ``manifest.json``: every other file's size and CRC-32, the step and the run id, written last
  (:mod:`megatron_zcpo.checkpoint.manifest`).
A LoRA policy's checkpoint (:mod:`megatron_zcpo.megatron.lora`) holds in ``weights/`` its adapters and
their optimizer state only, and ``lora.json``: the adapters' config and the base by path and
fingerprint (:mod:`megatron_zcpo.checkpoint.lora_base`); the base is loaded from ``model.path`` again.
Both are read with ``torch.load(weights_only=True)``: a checkpoint cannot run code when loaded.

Every rank writes into ``step_00000010.tmp`` and checksums (and fsyncs) the files it wrote; once all
ranks are done, rank 0 writes ``trainer_state.pt`` and the manifest, renames the directory and then
points ``<root>/latest`` at it (write + fsync + rename), so a crash (``kill -9`` of any rank at any
point) leaves either the old or the new checkpoint, never half of one: only complete directories
ever carry a ``step_XXXXXXXX`` name, and directories leave that name (renamed to ``*.discarded``)
before they are deleted. Leftovers of an interrupted save are removed by the next one. ``keep_last``
checkpoints are kept. The directory is probed at start-up and before each save
(:func:`check_checkpoint_dir`: writable, room for one more checkpoint the size of the last); a
failed write on any rank raises :class:`CheckpointWriteError` on every rank, naming the path.

A resume checks the newest checkpoint against its manifest first
(:mod:`megatron_zcpo.checkpoint.verify`); a damaged one is named, moved aside to
``step_XXXXXXXX.damaged`` (never deleted) and the newest intact one is used instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from megatron_zcpo.checkpoint.lora_base import LORA_RECORD, write_lora_record
from megatron_zcpo.checkpoint.manifest import (
    MANIFEST,
    CheckpointDamagedError,
    describe_files,
    files_written_by,
    fsync_directory,
    write_manifest,
)
from megatron_zcpo.megatron.lora import is_adapter_name, lora_of
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.utils.devices import has_cuda
from megatron_zcpo.utils.runtime import unwrap

STEP_PREFIX = "step_"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
_COMPLETE_NAME = re.compile(STEP_PREFIX + r"\d{8}")
_DISCARDED_SUFFIX = ".discarded"
_STAGING_SUFFIX = ".tmp"
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint moved out of the way of resumes and pruning, kept
_PROBE_BYTES = 4096
_PLAIN_TYPES = (str, int, float, bool, type(None), bytes, torch.Tensor)
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
    differing = [
        f"{key}: checkpoint {stored_fields[key]!r} vs run {model_fields[key]!r}"
        for key in stored_fields
        if key not in NON_ARCHITECTURE_FIELDS and stored_fields[key] != model_fields[key]
    ]
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
    if (Path(ckpt_dir) / LORA_RECORD).is_file():
        raise ValueError(
            f"{ckpt_dir} holds LoRA adapters only, not a model: merge them into their base first "
            "(python tools/convert_megatron_to_hf.py --ckpt ... writes the merged model), or resume the run"
        )
    stored_model = read_model_config(ckpt_dir)
    for chunk in chunks:
        check_same_architecture(stored_model, chunk.zcpo_model_config, ckpt_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    request = {}
    for index, chunk in enumerate(chunks):
        state = {
            name: value for name, value in chunk.sharded_state_dict().items() if not name.endswith(_EXTRA_STATE_SUFFIX)
        }
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
    """``root/step_XXXXXXXX``: where the checkpoint of ``step`` lives once complete."""
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


class CheckpointWriteError(OSError):
    """A checkpoint directory cannot be written (read-only, full, ...); the message names the path."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain values; it is not unpickled."""


def _is_complete(path: Path) -> bool:
    # Only a finished save is renamed to step_XXXXXXXX; one without its manifest (or, written before
    # manifests, without trainer_state.pt) lost files since, which verify_checkpoint names.
    return bool(_COMPLETE_NAME.fullmatch(path.name)) and (
        (path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file()
    )


def list_checkpoints(root: str | os.PathLike) -> List[Path]:
    """Complete checkpoints under ``root`` (renamed, with trainer state), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _is_complete(p)), key=lambda p: p.name)


def find_latest(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (``latest`` pointer first), or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if _is_complete(candidate):
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def check_checkpoint_dir(root: str | os.PathLike, needed_bytes: int = 0) -> None:
    """Probe that ``root`` can take a checkpoint: a file written and synced, ``needed_bytes`` free.

    A ``root`` that does not exist yet is probed at its nearest existing parent and left uncreated,
    so a run refused at start-up leaves nothing behind. Raises :class:`CheckpointWriteError` naming
    the path and the reason (read-only, no space, not a directory, ...). Cheap: one small file,
    removed again.
    """
    root = Path(root).absolute()
    existing = next(path for path in (root, *root.parents) if path.exists())
    probe = existing / ".zcpo_write_probe"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is not a directory")
        with open(probe, "wb") as handle:
            handle.write(b"\0" * _PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise CheckpointWriteError(f"checkpoint directory {root} is not writable: {error.strerror or error}") from error
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise CheckpointWriteError(
            f"checkpoint directory {root} has {free / 2**20:.1f} MiB free, but "
            f"a checkpoint needs about {needed_bytes / 2**20:.1f} MiB"
        )


def _directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_plain_state(value: Any, where: str = "trainer_state") -> None:
    """Refuse anything but tensors and plain values (what ``torch.load(weights_only=True)`` reads back).

    Raises ``TypeError`` naming the offending key path, e.g. ``trainer_state.loop.data``.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not a str or int")
            check_plain_state(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain_state(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(
            f"{where} is a {type(value).__name__}: checkpoints hold only tensors and plain values "
            "(dict, list, tuple, str, int, float, bool, None)"
        )


def read_plain_state(path: str | os.PathLike) -> Dict[str, Any]:
    """Load a checkpoint file of tensors and plain values without running any pickled code.

    Raises :class:`UnsafeCheckpointError` naming the file when it holds anything else (a
    crafted file, or one written by a version that stored arbitrary objects).
    """
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path} holds objects other than tensors and plain values and was not loaded (loading it "
            f"could run arbitrary code; only load checkpoints written by megatron_zcpo): {error}"
        ) from error


def rng_state() -> Dict[str, Any]:
    """This process's generator states (Python, torch, megatron-core's tracker, NumPy, CUDA), as a
    checkpoint holds them: tensors and plain values."""
    from megatron.core import tensor_parallel

    version, mt_words, gauss = random.getstate()
    state = {
        "python": {"version": version, "words": torch.tensor(mt_words, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
        "tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    if has_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore the generator states :func:`rng_state` returned."""
    from megatron.core import tensor_parallel

    python = state["python"]
    random.setstate((python["version"], tuple(python["words"].tolist()), python["gauss"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        numpy_state = state["numpy"]
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    if "cuda" in state and has_cuda():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(model, optimizer, is_loading: bool) -> Dict[str, Any]:
    model_state = unwrap(model).sharded_state_dict()
    if lora_of(model) is not None:  # the frozen base is not saved: model.path holds it
        model_state = {key: value for key, value in model_state.items() if is_adapter_name(key)}
    # fully_reshardable: loadable at any DP size (and the only distributed-optimizer format
    # that saves without CUDA); ignored by the plain optimizer.
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata),
    }


def _raise_if_any_rank_failed(error: Optional[BaseException], where: Path, payload: Any = None) -> List[Any]:
    """Collective: every rank raises :class:`CheckpointWriteError` when any rank's ``error`` is set;
    otherwise returns every rank's ``payload``, in rank order."""
    import torch.distributed as dist

    reports: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (None if error is None else f"{type(error).__name__}: {error}", payload))
    failed = {rank: message for rank, (message, _) in enumerate(reports) if message is not None}
    if failed:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        raise CheckpointWriteError(
            f"saving checkpoint {where} failed ({details}); the previous checkpoint is kept"
        ) from error
    return [payload for _, payload in reports]


def _discard(path: Path) -> None:
    """Rename ``path`` out of the checkpoint namespace first, then delete it: a crash mid-delete
    never leaves a half-deleted directory under a checkpoint's name."""
    doomed = path.with_name(path.name + _DISCARDED_SUFFIX)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _start_save(root: Path, tmp: Path) -> None:
    """Rank 0: clear leftovers of crashed saves, check the space, create the staging directory."""
    for leftover in root.glob(f"{STEP_PREFIX}*"):
        if leftover.name.endswith((_STAGING_SUFFIX, _DISCARDED_SUFFIX)):  # of an interrupted save
            shutil.rmtree(leftover, ignore_errors=True)
    previous = find_latest(root)
    check_checkpoint_dir(root, needed_bytes=_directory_bytes(previous) if previous is not None else 0)
    (tmp / "weights").mkdir(parents=True)
    (tmp / "rng").mkdir()


def _publish(root: Path, tmp: Path, final: Path, keep_last: int) -> None:
    """Rank 0: make the staged checkpoint visible under its name, then move ``latest`` to it."""
    if final.exists():  # re-saving a step (a resumed run): the old copy leaves the namespace first
        _discard(final)
    os.replace(tmp, final)
    fsync_directory(root)
    pointer = root / (LATEST + ".tmp")
    with open(pointer, "w") as handle:
        handle.write(final.name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(pointer, root / LATEST)
    fsync_directory(root)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        _discard(old)


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

    ``trainer_state`` holds the loop state: tensors and plain values only (checked before anything is
    written, ``TypeError`` naming the key), stored with the step and world size; its ``run_id``, when
    given, goes into the manifest too. The model's :class:`ModelConfig` is written beside the weights.
    Every rank checksums and fsyncs the files it wrote; rank 0 writes the manifest last. A write failure
    on any rank (read-only or full directory) raises :class:`CheckpointWriteError` on every rank naming
    the path, and leaves the previous checkpoint and ``latest`` as they were. Returns the checkpoint
    directory. A LoRA policy saves its adapters (and their optimizer state) alone, and
    ``trainer_state["lora"]`` (:func:`~megatron_zcpo.checkpoint.lora_base.lora_record`) as ``weights/lora.json``.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a shard's write failed on some rank

    trainer_state = {**trainer_state, "step": step, "world_size": dist.get_world_size()}
    check_plain_state(trainer_state)
    root, final = Path(root), step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            _start_save(root, tmp)
        except OSError as failure:
            error = failure
    _raise_if_any_rank_failed(error, tmp)
    described: Dict[str, Dict[str, Any]] = {}
    try:
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp / "weights"))
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            write_model_config(tmp / "weights", unwrap(model).zcpo_model_config)
            if lora_of(model) is not None:
                write_lora_record(tmp / "weights", trainer_state["lora"])
        described = describe_files(tmp, files_written_by(tmp, rank))
    except (OSError, CheckpointException) as failure:
        error = failure
    by_rank = _raise_if_any_rank_failed(error, tmp, described)
    if rank == 0:
        try:
            torch.save(trainer_state, tmp / TRAINER_STATE)
            write_manifest(
                tmp,
                {key: value for files in by_rank for key, value in files.items()},
                step=step,
                run_id=trainer_state.get("run_id"),
                world_size=dist.get_world_size(),
            )
            _publish(root, tmp, final, keep_last)
        except OSError as failure:
            error = failure
    _raise_if_any_rank_failed(error, final)
    return final


def load_checkpoint(path: str | os.PathLike, model, optimizer) -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    The stored model config is compared with the model's first (:class:`CheckpointMismatchError`
    naming the differing fields). Files are read as tensors and plain values only
    (:class:`UnsafeCheckpointError` for anything else: nothing pickled is executed). RNG states are
    restored when the world size matches. A state file that cannot be read raises
    :class:`CheckpointDamagedError` naming it, weights that cannot be loaded a ``RuntimeError``
    naming the checkpoint (check one first with
    :func:`megatron_zcpo.checkpoint.verify.verify_checkpoint`). Returns the trainer state
    dict. Collective over all ranks.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(path)
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAINER_STATE})")
    check_same_architecture(read_model_config(path / "weights"), unwrap(model).zcpo_model_config, path)
    trainer_state = read_checkpoint_file(path, TRAINER_STATE)
    try:
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path / "weights"))
    except Exception as error:
        raise RuntimeError(
            f"loading {path / 'weights'} failed ({_last_line(error)}); `zcpo checkpoint verify "
            f"{path}` checks every file's checksum"
        ) from error
    if lora_of(model) is None:
        unwrap(model).load_state_dict(loaded["model"])
    else:  # the adapters only: every one of them, nothing else
        _, unexpected = unwrap(model).load_state_dict(loaded["model"], strict=False)
        missing = [
            name
            for name, _ in unwrap(model).named_parameters()
            if is_adapter_name(name) and name not in loaded["model"]
        ]
        if missing or unexpected:
            raise KeyError(f"loading the adapters of {path}: missing {missing}, unexpected {unexpected}")
    optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if trainer_state.get("world_size") == dist.get_world_size() and rng_file.is_file():
        set_rng_state(read_checkpoint_file(path, rng_file.relative_to(path).as_posix()))
    return trainer_state


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def read_checkpoint_file(checkpoint: Path, relative: str) -> Dict[str, Any]:
    """:func:`read_plain_state` of ``checkpoint/relative``; a file torch cannot read (truncated,
    overwritten) raises :class:`CheckpointDamagedError` naming it."""
    try:
        return read_plain_state(checkpoint / relative)
    except UnsafeCheckpointError:
        raise
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointDamagedError(checkpoint, relative, f"cannot be read ({_last_line(error)})") from None
