"""A frozen module's tensors moved between the GPU and reused (pinned when CUDA) host buffers."""

from __future__ import annotations

from typing import Dict, List

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
