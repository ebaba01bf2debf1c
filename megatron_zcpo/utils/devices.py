"""The one place that decides devices: whether this process computes on CUDA, and on which device.

Every layer asks here (the pure math and the parallel ops too, which may not import the Megatron
layer); ``megatron/platform.py`` only adapts megatron-core to a machine without CUDA.
"""

from __future__ import annotations

import functools
import os

import torch

KERNEL_BACKENDS = ("auto", "torch", "triton")


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


def cuda_device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as torch prints it: what names a device across processes that
    see different ``CUDA_VISIBLE_DEVICES`` (SGLang maps a CUDA IPC handle's UUID to its own index)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def slot_device(slot: int) -> torch.device:
    """The device of GPU slot ``slot`` (``cuda:slot``) when this process sees CUDA, else the CPU."""
    return torch.device("cuda", slot) if has_cuda() else torch.device("cpu")


@functools.cache
def triton_importable() -> bool:
    """Whether ``import triton`` works in this process (asked once)."""
    try:
        import triton  # noqa: F401
    except Exception:  # an absent or broken install both mean: no Triton kernels
        return False
    return True


def kernel_backend(device: torch.device, requested: str = "auto") -> str:
    """Which kernels compute an op on tensors of ``device``: ``"triton"`` or ``"torch"``.

    ``auto``: Triton for CUDA tensors when triton imports, else the torch implementation (the CPU
    path and the reference). ``"triton"`` needs triton, and CUDA tensors or ``TRITON_INTERPRET=1``
    (Triton's interpreter then runs the kernels on CPU tensors, as the tests do). Raises
    ``ValueError`` naming the problem otherwise.
    """
    if requested not in KERNEL_BACKENDS:
        raise ValueError(f"backend={requested!r}: choose one of {', '.join(KERNEL_BACKENDS)}")
    if requested == "torch":
        return "torch"
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "triton" if on_cuda and triton_importable() else "torch"
    if not triton_importable():
        raise ValueError("backend='triton' but triton does not import here: install triton or use backend='torch'")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' on {device} tensors needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is first imported (Triton's interpreter; megatron-core imports triton)"
        )
    return "triton"


def gpu_memory_gib() -> float | None:
    """Memory of this node's first visible GPU in GiB, None without CUDA (or when nvidia-smi cannot say).

    Asks nvidia-smi rather than torch, so a launcher that only checks a layout creates no CUDA
    context on the GPU its ranks are about to use."""
    import subprocess

    if not has_cuda():
        return None
    first = (
        (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    )  # nvidia-smi -i takes an index or UUID
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", first],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(answer.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
