"""Hugging Face checkpoint files: lazy safetensors reads, sharded writes with an index, config and tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
# Files a Hugging Face model directory carries besides weights and config.json; copied through.
ASSET_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30

# safetensors header dtype names (https://github.com/huggingface/safetensors, "Format").
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face model directory; ``FileNotFoundError`` naming it."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    with open(path) as handle:
        return json.load(handle)


def write_hf_config(out_dir: str | os.PathLike, config: dict) -> None:
    """Write ``config`` as ``out_dir/config.json`` (the layout transformers writes)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(out_dir) / CONFIG_FILE, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")


def copy_hf_assets(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> List[str]:
    """Copy tokenizer files and generation_config.json present in ``src_dir``; returns their names."""
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ASSET_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, Path(dst_dir) / name)
            copied.append(name)
    return copied


class SafetensorsCheckpoint:
    """Read a (sharded) safetensors checkpoint one tensor at a time; nothing is read until asked.

    Files open memory-mapped on first use; :meth:`tensor` copies exactly one tensor out of them.
    Use as a context manager (or call :meth:`close`) to release the files.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.directory = Path(hf_dir)
        self._safe_open = safe_open
        self._handles: Dict[str, object] = {}
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            with open(index) as handle:
                self.weight_map: Dict[str, str] = dict(json.load(handle)["weight_map"])
        elif (self.directory / SINGLE_SAFETENSORS).is_file():
            self.weight_map = {name: SINGLE_SAFETENSORS for name in self._file(SINGLE_SAFETENSORS).keys()}  # noqa: SIM118 (safetensors 0.8: no __iter__)
        else:
            others = sorted(p.name for p in self.directory.glob("*.bin"))
            raise FileNotFoundError(
                f"{self.directory} has neither {SAFETENSORS_INDEX} nor {SINGLE_SAFETENSORS}"
                + (f" (found {others}: re-save the model with safetensors)" if others else "")
            )

    def _file(self, file_name: str):
        if file_name not in self._handles:
            path = self.directory / file_name
            if not path.is_file():
                raise FileNotFoundError(f"{path} (listed in {SAFETENSORS_INDEX}) does not exist")
            self._handles[file_name] = self._safe_open(str(path), framework="pt")
        return self._handles[file_name]

    def names(self) -> List[str]:
        """All tensor names in the checkpoint."""
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file_of(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return self._file(self.weight_map[name])

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a CPU copy); ``KeyError`` naming it when absent."""
        return self._file_of(name).get_tensor(name)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype of ``name`` (reads only the header)."""
        stored = self._file_of(name).get_slice(name)
        return torch.empty(stored.get_shape(), dtype=_SAFETENSORS_DTYPES[stored.get_dtype()], device="meta")

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap their files when released

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU in storage of its own (safetensors refuses views of shared storage)."""
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def write_safetensors_shards(
    out_dir: str | os.PathLike,
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    file_prefix: str = "model",
    write_index: bool = True,
) -> Dict[str, str]:
    """Write a stream of tensors as ``<file_prefix>-0000k-of-0000n.safetensors`` plus (unless
    ``write_index`` is False: one pipeline stage's share, indexed by the caller) ``model.safetensors.index.json``.

    Tensors are consumed one at a time and at most one shard (``max_shard_bytes``, or one
    bigger tensor) is held in memory. Raises ``ValueError`` naming a tensor that appears twice.
    Returns the weight map {tensor name: file name}.
    """
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: List[Tuple[Path, List[str]]] = []
    seen: set = set()
    shard: Dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        # The shard count is unknown until the stream ends: write numbered parts, rename after.
        path = out_dir / f"{file_prefix}-{len(parts) + 1:05d}.safetensors.part"
        save_file(shard, str(path), metadata={"format": "pt"})
        parts.append((path, list(shard)))

    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the stream written to {out_dir}")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = _compact(tensor)
        shard_bytes += nbytes
        total_bytes += nbytes
    if shard or not parts:
        flush()
    weight_map: Dict[str, str] = {}
    for number, (path, names) in enumerate(parts, start=1):
        file_name = f"{file_prefix}-{number:05d}-of-{len(parts):05d}.safetensors"
        os.replace(path, out_dir / file_name)
        weight_map.update({name: file_name for name in names})
    if write_index:
        write_safetensors_index(out_dir, weight_map, total_bytes)
    return weight_map


def write_safetensors_index(
    out_dir: str | os.PathLike, weight_map: Dict[str, str], total_bytes: Optional[int] = None
) -> None:
    """Write ``model.safetensors.index.json`` mapping each tensor name to its file."""
    metadata = {} if total_bytes is None else {"total_size": total_bytes}
    with open(Path(out_dir) / SAFETENSORS_INDEX, "w") as handle:
        json.dump({"metadata": metadata, "weight_map": weight_map}, handle, indent=2)
        handle.write("\n")
