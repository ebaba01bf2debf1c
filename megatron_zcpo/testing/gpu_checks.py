"""What the prepared GPU checks (tools/gpu_check_*.py) share: their exit statuses and their table of rows."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3


def report(rows: Sequence[Tuple[str, bool, str]], on_gpu: bool, no_gpu_line: Optional[str] = None) -> int:
    """Print the (check, ok, detail) rows as an aligned table; the exit status: :data:`EXIT_FAILED` when a
    row failed, else :data:`EXIT_NO_GPU` without a GPU (after ``no_gpu_line``: what was skipped), else
    :data:`EXIT_OK`."""
    width = max(len(name) for name, _, _ in rows)
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'ok' if ok else 'FAILED':<6}  {detail}")
    if not all(ok for _, ok, _ in rows):
        return EXIT_FAILED
    if not on_gpu:
        print(no_gpu_line or "no GPU: ran on the CPU")
        return EXIT_NO_GPU
    return EXIT_OK
