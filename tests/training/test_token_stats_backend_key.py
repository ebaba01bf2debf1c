"""``train.token_stats_backend``: validated by name, checked where the ranks start, passed to the fused op."""

import pytest
import torch

from megatron_zcpo.training.config import TrainConfig, check_token_stats_backend
from megatron_zcpo.training.experience import TokenStatsOptions, token_stats_on_shard


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match=r"train\.token_stats_backend must be one of auto, torch, triton, got 'cuda'"):
        TrainConfig(token_stats_backend="cuda").validate()
    TrainConfig(token_stats_backend="triton").validate()  # whether it runs is decided where the ranks start


def test_the_backend_is_checked_on_the_ranks_device(monkeypatch):
    cpu = torch.device("cpu")
    assert check_token_stats_backend(TrainConfig(), cpu) == "torch"  # auto: Triton only on CUDA
    assert check_token_stats_backend(TrainConfig(token_stats_backend="torch"), cpu) == "torch"
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"train\.token_stats_backend=triton: .*needs CUDA tensors"):
        check_token_stats_backend(TrainConfig(token_stats_backend="triton"), cpu)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_option_reaches_the_op(backend, monkeypatch):
    """TokenStatsOptions.backend (the trainer's train.token_stats_backend) selects the kernels that run."""
    from megatron.core import parallel_state

    if backend == "triton":
        pytest.importorskip("triton")
    from megatron_zcpo.ops import token_stats_triton

    calls = []
    fused_forward = token_stats_triton.fused_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return fused_forward(*args, **kwargs)

    monkeypatch.setattr(token_stats_triton, "fused_forward", counted)
    monkeypatch.setattr(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", 1)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 8, generator=gen), torch.randn(32, 8, generator=gen)
    targets = torch.randint(0, 30, (6,), generator=gen)
    options = TokenStatsOptions(vocab_size=30, chunk_size=4, temperature=1.0, backend=backend)
    stats = token_stats_on_shard(hidden, weight, targets, options=options)
    exact = torch.log_softmax(hidden.double() @ weight[:30].double().t(), dim=-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(stats.logprob.double(), exact, rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if backend == "triton" else 0)
