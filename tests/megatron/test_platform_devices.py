"""One GPU per task: the CUDA device a rank binds to, with a monkeypatched device count (no GPU needed)."""

import pytest
import torch

from megatron_zcpo.megatron import initialize
from megatron_zcpo.utils import devices


@pytest.mark.parametrize(
    "visible,local_rank,expected",
    [
        (1, 0, 0),
        (1, 3, 0),
        (1, 7, 0),  # srun --gpus-per-task=1: each task's own GPU is device 0
        (8, 0, 0),
        (8, 3, 3),
        (8, 7, 7),  # all of the node's GPUs visible: device LOCAL_RANK
        (4, 2, 2),
    ],
)
def test_local_cuda_device(monkeypatch, visible, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert devices.local_cuda_device(local_rank) == expected


def test_local_cuda_device_refuses_a_device_that_is_not_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="LOCAL_RANK=5 but this task sees 4 CUDA device"):
        devices.local_cuda_device(5)


def test_process_group_binds_the_visible_device_under_one_gpu_per_task(monkeypatch):
    """Task with SLURM_LOCALID=3 and one visible GPU binds device 0 and uses NCCL."""
    import torch.distributed as dist

    bound, groups = [], []
    monkeypatch.setattr(initialize, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: groups.append(kwargs))
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    initialize._init_process_group(timeout_s=60)
    assert bound == [0]
    assert groups[0]["backend"] == "nccl" and groups[0]["rank"] == 3 and groups[0]["world_size"] == 4
