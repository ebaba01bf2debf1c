"""Reference offload: reused (pinned when CUDA) host buffers, exact round trips."""

import torch

from megatron_zcpo.megatron.offload import HostOffload


def _module():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    module.register_buffer("scale", torch.arange(3.0))
    return module


def test_offload_round_trips_exactly_and_reuses_pinned_host_buffers(monkeypatch):
    pinned = []

    def pin_memory(self):  # stands in for page-locking, which needs a CUDA device
        pinned.append(self)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    module = _module()
    original = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    offload = HostOffload(module, pin=True)
    offload.to_host()
    first = [t.data_ptr() for t in list(module.parameters()) + list(module.buffers())]
    assert len(pinned) == len(first) == 5  # 2 + 2 parameters, 1 buffer: each pinned once
    offload.to_device("cpu")
    for parameter in module.parameters():
        parameter.data = parameter.data.clone()  # as if it lived on the GPU meanwhile
    offload.to_host()
    assert [t.data_ptr() for t in list(module.parameters()) + list(module.buffers())] == first  # reused buffers
    assert len(pinned) == 5  # no new pinned allocation
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in original.items())


def test_without_cuda_nothing_is_pinned(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: (_ for _ in ()).throw(AssertionError("pinned")))
    module = _module()
    expected = module(torch.ones(2, 4))
    offload = HostOffload(module, pin=False)
    offload.to_host()
    offload.to_device("cpu")
    assert torch.equal(module(torch.ones(2, 4)), expected)
