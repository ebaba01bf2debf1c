"""The one place that decides devices: whether this process computes on CUDA, and on which device.

Every layer asks here (the pure math and the parallel ops too, which may not import the Megatron
layer); ``megatron/platform.py`` only adapts megatron-core to a machine without CUDA.
"""

from __future__ import annotations

import torch


def has_cuda() -> bool:
    """Whether this process computes on a CUDA GPU (the only place that asks torch)."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """Where models and collective buffers live: ``cuda`` (the current device) with CUDA, else ``cpu``."""
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def local_cuda_device(local_rank: int) -> int:
    """The CUDA device index this process should use, given its rank on the node.

    With one device visible (``srun --gpus-per-task=1`` or a per-task ``CUDA_VISIBLE_DEVICES``)
    every task sees only its own GPU as device 0, whatever its LOCAL_RANK; with several visible,
    tasks share the node's devices and take device ``local_rank``. Raises ``ValueError`` when
    ``local_rank`` names a device that is not visible.
    """
    count = torch.cuda.device_count()
    if count == 1:
        return 0
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this task sees {count} CUDA device(s): start one task per"
            " GPU with as many visible devices as tasks per node, or one visible device per task"
        )
    return local_rank


def gpu_memory_gib() -> "float | None":
    """Memory of this node's first visible GPU in GiB, None without CUDA (or when nvidia-smi cannot say).

    Asks nvidia-smi rather than torch, so a launcher that only checks a layout creates no CUDA
    context on the GPU its ranks are about to use."""
    import os
    import subprocess

    if not has_cuda():
        return None
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()  # nvidia-smi -i takes an index or UUID
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", first],
                                capture_output=True, text=True, timeout=30, check=True).stdout
        return float(answer.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
