"""CUDA IPC on a CPU, for tests: handles that name a GPU slot by a fake device UUID, opened only where it is visible.

A colocated push hands each SGLang TP rank a pickle of torch's ``rebuild_cuda_tensor`` whose
arguments name the storage's device (torch 2.10 .. 2.14.1 ``multiprocessing/reductions.py``:
15 arguments, the device at position 6), by UUID once the sender replaced the index (SGLang's rule,
``utils/patch_torch.py``; ours: ``update_weight/tensor_ipc.py``). Without CUDA,
:func:`emulate_gpu` makes this process's tensors reduce in exactly that shape, as tensors on
``cuda:<slot>`` would (the device index ``slot``, the tensor's shared-memory file from torch's
``file_system`` sharing in place of the cudaIpcMemHandle), and gives device ``slot`` the UUID
:func:`fake_device_uuid`; the production code then swaps the index for the UUID as it does on a
GPU. :func:`load_blob` unpickles a blob as an SGLang 0.5.3.post3 / 0.5.23 TP rank that sees the
GPUs ``visible`` does: the UUID mapped to its index among them (``_device_from_maybe_uuid``),
``Invalid device_uuid=...`` for any other, then the storage opened (:func:`open_fake_cuda_handle`,
torch's rebuild with the shared-memory file for the handle). ``tests/rollout/sglang/test_tensor_ipc.py``
holds this emulation against both wheels' own ``patch_torch`` and deserialiser.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import pickle
from typing import Iterator, Sequence

import torch

UUID_PREFIX = "GPU-fa4e0000-0000-0000-0000-"


class HandleError(Exception):
    """A handle the receiving process cannot open on the sender's GPU (SGLang raises a bare Exception with
    the same words; on a server it is uncaught and kills the scheduler)."""


def fake_device_uuid(slot: int) -> str:
    """The UUID GPU slot ``slot`` has in the emulation (the same in every process)."""
    return f"{UUID_PREFIX}{slot:012d}"


def _reduce_as_cuda(slot: int, tensor: torch.Tensor):
    """torch's CUDA reduction of ``tensor`` as if it lived on ``cuda:<slot>``: rebuild_cuda_tensor and its
    15 arguments, the storage's shared-memory file (manager, name) as the handle."""
    from torch.multiprocessing import reductions

    storage = tensor.untyped_storage()
    manager, name, nbytes = storage._share_filename_cpu_()
    return reductions.rebuild_cuda_tensor, (
        type(tensor),
        tensor.size(),
        tensor.stride(),
        tensor.storage_offset(),
        torch.storage.TypedStorage,
        tensor.dtype,
        slot,  # the device index: the sender replaces it with the device's UUID
        (manager, name, slot),  # the memory's own GPU travels in the handle, as a cudaIpcMemHandle's does
        nbytes,
        0,
        tensor.requires_grad,
        None,
        0,
        None,
        False,
    )


@contextlib.contextmanager
def emulate_gpu(slot: int) -> Iterator[None]:
    """Within the ``with``: this process's tensors reduce as CUDA tensors on ``cuda:<slot>`` do, and device
    ``i``'s UUID is :func:`fake_device_uuid` (``i``), as the tensor transport asks it."""
    from torch.multiprocessing import reductions

    from megatron_zcpo.rollout.sglang.update_weight import tensor_ipc

    saved = reductions.reduce_tensor, tensor_ipc.cuda_device_uuid
    reductions.reduce_tensor = functools.partial(_reduce_as_cuda, slot)
    tensor_ipc.cuda_device_uuid = fake_device_uuid
    try:
        yield
    finally:
        reductions.reduce_tensor, tensor_ipc.cuda_device_uuid = saved


def open_fake_cuda_handle(
    visible: Sequence[str],
    tensor_cls,
    tensor_size,
    tensor_stride,
    tensor_offset,
    storage_cls,
    dtype,
    storage_device,
    storage_handle,
    storage_size_bytes,
    storage_offset_bytes,
    requires_grad,
    *ref_counter_and_event,
):
    """torch's ``rebuild_cuda_tensor`` for an emulated handle in a process that sees the GPUs ``visible``:
    the tensor over the shared-memory storage it names, tagged ``fake_device`` = ``storage_device``
    (the index it was opened on). Raises where CUDA would not give the sender's memory: an index
    this process does not have, or one that is another GPU than the memory's (a bare index, not
    mapped from the UUID)."""
    manager, name, slot = storage_handle
    if not 0 <= storage_device < len(visible):
        raise HandleError(f"CUDA error: invalid device ordinal {storage_device} (this process sees {len(visible)})")
    if visible[storage_device] != fake_device_uuid(slot):
        raise HandleError(
            f"the handle of GPU slot {slot}'s memory was opened on device {storage_device} ({visible[storage_device]})"
        )
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, storage_size_bytes)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    tensor = torch._utils._rebuild_tensor(typed, tensor_offset, tensor_size, tensor_stride)
    tensor.fake_device = storage_device
    return tensor


def _rebuild_on_visible(visible: Sequence[str], *args):
    """SGLang's patched rebuild (``_rebuild_cuda_tensor_modified``) in a process that sees ``visible``."""
    device = args[6]
    if isinstance(device, str):
        if device not in visible:
            raise HandleError("Invalid device_uuid=" + device)  # SGLang's own words (patch_torch.py)
        device = list(visible).index(device)
    return open_fake_cuda_handle(visible, *args[:6], device, *args[7:])


class _TPRankUnpickler(pickle.Unpickler):
    def __init__(self, file, visible: Sequence[str]):
        super().__init__(file)
        self.visible = list(visible)

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return functools.partial(_rebuild_on_visible, self.visible)
        return super().find_class(module, name)


def load_blob(blob: str, visible: Sequence[str]):
    """What an SGLang TP rank seeing the GPUs of UUIDs ``visible`` unpickles from ``blob`` (base64); raises
    :class:`HandleError` ``Invalid device_uuid=...`` for a handle of a GPU it cannot see. Plain CPU tensors
    (torch's shared-memory reduction) open anywhere."""
    import torch.multiprocessing  # noqa: F401  (torch's rebuild functions for the CPU path)

    return _TPRankUnpickler(io.BytesIO(base64.b64decode(blob, validate=True)), visible).load()
