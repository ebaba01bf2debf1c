"""Checkpoint manifests: every file's size and checksum, written last, and the file-level checks of a checkpoint.

A training checkpoint (see :mod:`megatron_zcpo.checkpoint.io`) ends with ``manifest.json``:
the relative path, size and CRC-32 of every other file in it, plus the step and run id. Each rank
checksums the files it wrote itself (read back from the page cache right after writing, and fsynced),
global rank 0 adds the shared files and writes the manifest last (write, fsync, rename), before the
checkpoint directory is renamed into place. So the work of checksumming is spread over the ranks,
like the writing.

Two levels of checking (:func:`check_files`):

* ``quick`` (every resume): each manifest entry exists with its recorded size, and every byte range
  the checkpoint library's own index (torch.distributed.checkpoint's ``.metadata``) will read lies
  inside its file. Metadata and ``stat`` calls only: seconds even for a 70B run's hundreds of
  files and ~1 TB of weights and optimizer state. It catches what actually happens to checkpoints:
  a copy or a save cut short (disk full, killed job, quota), a missing file, an empty file.
* ``full`` (``zcpo checkpoint verify``): also every file's CRC-32, which reads every byte (minutes
  at that size), for bit rot or a file replaced by another of the same size.

Checkpoints written before manifests existed have none: they get the library-index check only.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Optional

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CHECKSUM = "crc32"  # zlib's CRC-32: the integrity check of zip/gzip; ~3x faster here than SHA-256
_READ_BYTES = 8 * 2**20
# torch.distributed.checkpoint's FileSystemWriter names a rank's shard files __<rank>_<n>.distcp
_SHARD_FILE = r"(?:.*_)?__{rank}_\d+\.distcp"
_LIBRARY_INDEX = ".metadata"  # torch.distributed.checkpoint's index: which byte range holds each tensor


class CheckpointDamagedError(ValueError):
    """A checkpoint file is missing, truncated or altered; ``file`` is its path inside ``checkpoint``."""

    def __init__(self, checkpoint: os.PathLike | str, file: str, reason: str):
        self.checkpoint, self.file, self.reason = Path(checkpoint), file, reason
        super().__init__(f"checkpoint {checkpoint} is damaged: {file}: {reason}")

    def __reduce__(self):  # rank 0 sends it to the other ranks (they stop with the same error)
        return type(self), (self.checkpoint, self.file, self.reason)


def describe_file(path: Path) -> Dict[str, object]:
    """``{"size": bytes, "crc32": "8 hex digits"}`` of ``path``, after fsyncing it (it is durable once described)."""
    checksum, size = 0, 0
    block = bytearray(_READ_BYTES)  # one buffer reused: no allocation per read
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            checksum = zlib.crc32(view[:count], checksum)
            size += count
        os.fsync(handle.fileno())
    return {"size": size, CHECKSUM: f"{checksum:08x}"}


def files_written_by(directory: Path, rank: int) -> List[str]:
    """Relative paths of the files rank ``rank`` wrote into the staged checkpoint ``directory``:
    its shard files under ``weights/`` and its ``rng/rank_XXXXX.pt``."""
    pattern = re.compile(_SHARD_FILE.format(rank=rank))
    shards = [f"weights/{p.name}" for p in (directory / "weights").iterdir() if pattern.fullmatch(p.name)]
    rng = f"rng/rank_{rank:05d}.pt"
    return sorted(shards) + ([rng] if (directory / rng).is_file() else [])


def describe_files(directory: Path, relative_paths: Iterable[str]) -> Dict[str, Dict[str, object]]:
    """:func:`describe_file` of each of ``relative_paths`` under ``directory``."""
    return {relative: describe_file(directory / relative) for relative in relative_paths}


def write_manifest(directory: Path, described: Dict[str, Dict[str, object]], **fields) -> None:
    """Write ``directory/manifest.json`` last: ``described`` plus every other file under ``directory``
    (described here), and ``fields`` (step, run_id, world_size); written to a temporary name,
    fsynced and renamed, so a manifest is either whole or absent."""
    described = dict(described)
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative not in described and not relative.startswith(MANIFEST):
            described[relative] = describe_file(path)
    manifest = {
        "format": MANIFEST_FORMAT,
        "checksum": CHECKSUM,
        **fields,
        "files": {key: described[key] for key in sorted(described)},
    }
    staged = directory / (MANIFEST + ".tmp")
    with open(staged, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, directory / MANIFEST)
    for folder in {directory} | {(directory / key).parent for key in described}:
        fsync_directory(folder)


def fsync_directory(path: Path) -> None:
    """Make the entries (creations, renames) of directory ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_manifest(checkpoint: Path) -> Optional[dict]:
    """The manifest of ``checkpoint``, or None for a checkpoint written before manifests existed.

    Raises :class:`CheckpointDamagedError` when it cannot be read as one."""
    path = checkpoint / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
    except (OSError, ValueError) as error:
        raise CheckpointDamagedError(checkpoint, MANIFEST, f"unreadable ({error})") from None
    return manifest


def check_files(checkpoint: Path, manifest: Optional[dict], *, full: bool = False) -> int:
    """Check ``checkpoint``'s files against ``manifest`` (sizes; with ``full`` also checksums) and
    against the checkpoint library's index of ``weights/``; returns the bytes checked.

    ``manifest``: from :func:`read_manifest` (None: only the library's index is checked). Raises
    :class:`CheckpointDamagedError` naming the first bad file.
    """
    total = 0
    for relative, recorded in (manifest or {}).get("files", {}).items():
        path = checkpoint / relative
        if not path.is_file():
            raise CheckpointDamagedError(checkpoint, relative, "missing (listed in its manifest)")
        size = path.stat().st_size
        if size != recorded["size"]:
            raise CheckpointDamagedError(
                checkpoint,
                relative,
                f"{size:,} bytes, but its manifest records {recorded['size']:,} (truncated or overwritten)",
            )
        if full:
            found = describe_file(path)[CHECKSUM]
            if found != recorded.get(CHECKSUM):
                raise CheckpointDamagedError(
                    checkpoint,
                    relative,
                    f"{CHECKSUM} {found}, but its manifest records {recorded.get(CHECKSUM)} (the contents changed)",
                )
        total += size
    check_library_index(checkpoint)
    return total


def check_library_index(checkpoint: Path) -> None:
    """Every byte range torch.distributed.checkpoint's index (``weights/.metadata``) says holds a
    tensor lies inside an existing file; raises :class:`CheckpointDamagedError` naming the file."""
    from torch.distributed.checkpoint import FileSystemReader

    weights = checkpoint / "weights"
    if not (weights / _LIBRARY_INDEX).is_file():
        raise CheckpointDamagedError(
            checkpoint, f"weights/{_LIBRARY_INDEX}", "missing (the index of the saved tensors)"
        )
    try:
        metadata = FileSystemReader(str(weights)).read_metadata()
    except Exception as error:
        raise CheckpointDamagedError(
            checkpoint, f"weights/{_LIBRARY_INDEX}", f"unreadable ({type(error).__name__}: {error})"
        ) from None
    needed: Dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(needed.items()):
        path = weights / name
        if not path.is_file():
            raise CheckpointDamagedError(checkpoint, f"weights/{name}", "missing (the library's index reads from it)")
        size = path.stat().st_size
        if size < end:
            raise CheckpointDamagedError(
                checkpoint,
                f"weights/{name}",
                f"{size:,} bytes, but the library's index reads up to byte {end:,} (truncated)",
            )
