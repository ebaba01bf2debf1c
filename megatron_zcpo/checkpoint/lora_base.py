"""A LoRA run's base model by fingerprint: what its checkpoints record, and the checks before a resume or a merge.

A LoRA checkpoint holds the adapters and their optimizer state only; the base they were trained on is
named by path and by :func:`base_fingerprint`, a SHA-256 over the base's weight and config files:
each file's relative path and size and, for a file over :data:`WHOLE_FILE_BYTES`,
:data:`SAMPLES` evenly spaced blocks of :data:`SAMPLE_BYTES` (the whole file otherwise). It reads
about 4 MiB per file, seconds for a 70B base on a shared filesystem, rather than the 140 GB a full
hash would; every other base (another fine-tune, another dtype, a re-sharded copy) differs in it.
The record lives in ``trainer_state.pt`` and, for tools without a trainer, in ``weights/lora.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

LORA_RECORD = "lora.json"  # in a LoRA checkpoint's weights/: {"config": LoraConfig fields, "base": {...}}
SAMPLES = 64
SAMPLE_BYTES = 64 * 2**10
WHOLE_FILE_BYTES = SAMPLES * SAMPLE_BYTES
# Files that hold a base's weights or architecture (HF: safetensors / bin + config.json; Megatron:
# torch_dist shards, their index and common state + model_config.json).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp", ".metadata", ".pt")
_CONFIG_FILES = ("config.json", "model_config.json")


class LoraCheckpointMismatchError(ValueError):
    """A LoRA checkpoint does not belong to this run (no adapters, other adapters or another base)."""


def _weight_files(root: Path):
    return sorted(
        path
        for path in root.rglob("*")
        if path.is_file() and (path.suffix in _WEIGHT_SUFFIXES or path.name in _CONFIG_FILES)
    )


def base_fingerprint(path: str | os.PathLike) -> str:
    """The SHA-256 fingerprint (hex) of the base model directory ``path`` (module docstring).

    Raises ``FileNotFoundError`` naming ``path`` when it holds no weight file."""
    root = Path(path)
    files = _weight_files(root) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path}: no weight files to fingerprint (safetensors, bin or torch_dist shards)")
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if size <= WHOLE_FILE_BYTES:
                digest.update(handle.read())
                continue
            for index in range(SAMPLES):
                handle.seek((size - SAMPLE_BYTES) * index // (SAMPLES - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def lora_record(lora, base: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What a LoRA checkpoint records: the adapters' config (``lora``, a LoraConfig) and ``base``
    ({"path", "fingerprint"}, or None for a randomly initialised base)."""
    return {"config": dataclasses.asdict(lora), "base": dict(base) if base else None}


def write_lora_record(weights_dir: str | os.PathLike, record: Dict[str, Any]) -> None:
    """Store ``record`` (:func:`lora_record`) as ``weights_dir/lora.json``."""
    with open(Path(weights_dir) / LORA_RECORD, "w") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_lora_record(weights_dir: str | os.PathLike) -> Optional[Dict[str, Any]]:
    """The record of a LoRA checkpoint's ``weights/`` directory, or None when it holds a whole model."""
    path = Path(weights_dir) / LORA_RECORD
    if not path.is_file():
        return None
    with open(path) as handle:
        return json.load(handle)


# LoraConfig fields that decide the adapters' tensors (dropout and the push mode may change on resume).
_SHAPE_FIELDS = ("rank", "alpha", "targets", "init")


def check_lora_resume(record: Optional[Dict[str, Any]], lora, base: Optional[Dict[str, Any]], checkpoint) -> None:
    """Refuse resuming ``checkpoint`` (whose ``weights/lora.json`` is ``record``) into a run with
    ``lora`` (a LoraConfig, or None for full fine-tuning) on ``base`` ({"path", "fingerprint"} or
    None): raises :class:`LoraCheckpointMismatchError` naming the keys and both values."""
    if record is None and lora is None:
        return
    if record is None:
        raise LoraCheckpointMismatchError(
            f"checkpoint {checkpoint} holds a whole fine-tuned model, this run sets model.lora: "
            "resume it without model.lora (or start the LoRA run afresh: checkpoint.resume=never)"
        )
    if lora is None:
        raise LoraCheckpointMismatchError(
            f"checkpoint {checkpoint} holds LoRA adapters only ({record['config']}): set the same model.lora "
            "to resume it"
        )
    stored, current = record["config"], dataclasses.asdict(lora)
    differing = [f"model.lora.{key}: checkpoint {stored[key]!r} vs run {current[key]!r}" for key in _SHAPE_FIELDS]
    differing = [line for key, line in zip(_SHAPE_FIELDS, differing) if stored[key] != current[key]]
    if differing:
        raise LoraCheckpointMismatchError(f"checkpoint {checkpoint} holds other adapters: " + "; ".join(differing))
    stored_base = record.get("base") or {}
    if bool(base) != bool(stored_base) or (base and stored_base.get("fingerprint") != base.get("fingerprint")):
        raise LoraCheckpointMismatchError(
            f"checkpoint {checkpoint} trained its adapters on {_describe(stored_base)}, this run's base is "
            f"{_describe(base)}: point model.path at the base it was trained on"
        )


def _describe(base: Optional[Dict[str, Any]]) -> str:
    if not base:
        return "a randomly initialised base (model.architecture)"
    return f"{base.get('path')} (fingerprint {str(base.get('fingerprint'))[:16]}...)"
