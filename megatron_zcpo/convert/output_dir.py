"""A converter's output directory, written whole or not at all: into a fresh sibling, renamed into place.

An existing non-empty ``--out`` is refused unless overwriting was asked for; then the old
directory is replaced only once the new one is complete (files of the old one never mix with the
new: transformers would load a stale ``model.safetensors`` before a new index), and a failed
conversion leaves it untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Optional


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


@contextlib.contextmanager
def atomic_output_dir(
    out_dir: str | os.PathLike, *, overwrite: bool = False, source: Optional[str | os.PathLike] = None
) -> Iterator[Path]:
    """Yield a fresh directory beside ``out_dir`` to write into; on success it becomes ``out_dir``.

    Raises ``FileExistsError`` when ``out_dir`` is a non-empty directory (or a file) and
    ``overwrite`` is False, and ``ValueError`` when overwriting would delete ``source`` (the
    converter's input inside ``out_dir``). On an exception the partial output is removed and
    ``out_dir`` is left as it was.
    """
    out = Path(out_dir).absolute()
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty: pass --overwrite (overwrite=True) to replace it once the "
            f"conversion is complete, or choose a new or empty --out"
        )
    if occupied and source is not None and _inside(Path(source).absolute(), out):
        raise ValueError(f"--out {out_dir} holds the input {source}: replacing it would delete the input")
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    fresh = out.with_name(f".{out.name}.tmp-{tag}")
    fresh.mkdir()
    try:
        yield fresh
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{tag}")
        os.replace(out, old)
        os.replace(fresh, out)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(fresh, out)
