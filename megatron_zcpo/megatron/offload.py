"""A frozen module's tensors moved between the GPU and reused (pinned when CUDA) host buffers."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch


class HostOffload:
    """Offload ``module``'s parameters and buffers to host memory between uses, and bring them back.

    The host copies live in buffers allocated once and reused by every offload; with ``pin``
    (ask ``megatron_zcpo.utils.devices.has_cuda()``) they are page-locked, so both
    directions are asynchronous DMA copies (``non_blocking``) ordered on the current CUDA stream
    instead of a synchronous pageable round trip per tensor. For modules without gradients (the
    reference model): the tensors' ``.data`` are swapped, so the module object stays the same.
    """

    def __init__(self, module: torch.nn.Module, pin: bool):
        self.module = module
        self.pin = bool(pin)
        self._host: Dict[int, torch.Tensor] = {}

    def _tensors(self) -> List[torch.Tensor]:
        return list(self.module.parameters()) + list(self.module.buffers())

    def to_host(self) -> None:
        """Copy every tensor into its host buffer (allocated and pinned on first use) and keep that."""
        for index, tensor in enumerate(self._tensors()):
            host = self._host.get(index)
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                if self.pin:
                    host = host.pin_memory()
                self._host[index] = host
            if host.data_ptr() != tensor.data_ptr():
                host.copy_(tensor.detach(), non_blocking=self.pin)
            tensor.data = host

    def to_device(self, device) -> None:
        """Copy every tensor to ``device`` (the host buffers stay allocated for the next offload)."""
        for tensor in self._tensors():
            tensor.data = tensor.data.to(device, non_blocking=self.pin)


TRAINING_PARTS = ("params", "grads", "optimizer")


def _storages(tensors) -> Dict[int, torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views of one buffer share one), keyed by identity."""
    found: Dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        found.setdefault(storage._cdata, storage)
    return found


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class TrainingStateOffload:
    """The trainer's parameters, gradients and optimizer states moved off the device and back, bit-exactly.

    Colocated placement (training and the inference engine on the same GPUs) hands the device to the
    engine between training phases. Each part is a set of storages (``params``: the policy's
    parameters and megatron-core DDP's parameter buffers; ``grads``: its gradient buffers, the
    ``main_grad`` views into them and any ``.grad``; ``optimizer``: the optimizer's fp32 main
    parameters and its state): :meth:`offload` copies a storage into a host buffer (allocated once,
    page-locked with ``pin``) and resizes the storage to 0 bytes, which frees the device memory while
    every view (a parameter inside a DDP buffer, ``main_grad``) keeps pointing at the same storage;
    :meth:`onload` resizes it back and copies the bytes in. ``policy``: the DDP-wrapped model chunk;
    ``optimizer``: megatron-core's (chained or not).
    """

    def __init__(self, policy: torch.nn.Module, optimizer, pin: bool):
        self.policy, self.optimizer, self.pin = policy, optimizer, bool(pin)
        self._host: Dict[int, torch.Tensor] = {}
        self.offloaded: set = set()

    def _torch_optimizers(self) -> List[torch.optim.Optimizer]:
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [getattr(opt, "optimizer", opt) for opt in chained]

    def _part_storages(self, part: str) -> Dict[int, torch.UntypedStorage]:
        params = list(self.policy.parameters())
        ddp_buffers = [
            buffer
            for name in ("buffers", "expert_parallel_buffers")  # megatron-core DDP's flat buffers
            if isinstance(getattr(self.policy, name, None), list)
            for buffer in getattr(self.policy, name)
        ]
        if part == "params":
            tensors = params + [getattr(b, "param_data", None) for b in ddp_buffers]
        elif part == "grads":
            tensors = [getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]
            tensors += [getattr(b, "grad_data", None) for b in ddp_buffers]
            tensors += [p.grad for opt in self._torch_optimizers() for g in opt.param_groups for p in g["params"]]
        elif part == "optimizer":
            tensors = [p for opt in self._torch_optimizers() for g in opt.param_groups for p in g["params"]]
            tensors += [v for opt in self._torch_optimizers() for s in opt.state.values() for v in s.values()]
        else:
            raise ValueError(f"unknown training-state part {part!r}; choose from {TRAINING_PARTS}")
        found = _storages(tensors)
        if part != "params":  # an fp32 optimizer updates the model's own parameters: they stay "params"
            for key in _storages(params):
                found.pop(key, None)
        if part == "optimizer":
            for key in self._part_storages("grads"):
                found.pop(key, None)
        return found

    def nbytes(self, parts: Sequence[str] = TRAINING_PARTS) -> int:
        """Device bytes ``parts`` take when on the device."""
        return sum(self._size(key, storage) for part in parts for key, storage in self._part_storages(part).items())

    def _size(self, key: int, storage: torch.UntypedStorage) -> int:
        host = self._host.get(key)
        return storage.nbytes() or (host.numel() if host is not None else 0)

    def offload(self, parts: Sequence[str]) -> int:
        """Move ``parts`` off the device (a part already off is skipped); returns the bytes freed."""
        freed = 0
        for part in parts:
            if part in self.offloaded:
                continue
            for key, storage in self._part_storages(part).items():
                size = storage.nbytes()
                host = self._host.get(key)
                if host is None or host.numel() != size:
                    host = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
                    self._host[key] = host
                host.copy_(_byte_view(storage), non_blocking=self.pin)
                freed += size
            if self.pin:
                torch.cuda.synchronize()  # the copies must land before the storage goes
            for storage in self._part_storages(part).values():
                storage.resize_(0)
            self.offloaded.add(part)
        return freed

    def onload(self, parts: Sequence[str]) -> int:
        """Bring ``parts`` back to the device bit for bit; returns the bytes restored."""
        restored = 0
        for part in parts:
            if part not in self.offloaded:
                continue
            for key, storage in self._part_storages(part).items():
                host = self._host[key]
                storage.resize_(host.numel())
                _byte_view(storage).copy_(host, non_blocking=self.pin)
                restored += host.numel()
            self.offloaded.discard(part)
        if self.pin and restored:
            torch.cuda.synchronize()
        return restored
