"""Megatron-core GPTModel on CPU over gloo: TP/PP/DP layouts match one process exactly."""

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.testing import run_distributed

MODEL = ModelConfig(
    family="qwen2",
    vocab_size=500,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
GLOBAL_BATCH, SEQ = 4, 12


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, SEQ), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=gen) > 0.25).float()  # uneven counts per row
    return tokens, labels, mask


def _reference_weights(rank, world, model_config):
    """Global weights from a single-process model with a fixed seed (run inside a 1-rank group)."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict

    setup_megatron(seed=11)
    model = build_gpt_model(model_config, transformer_config(model_config))
    return gather_full_state_dict(model)


def _train_one_step(rank, world, tp, pp, model_config, weights, distributed_optimizer):
    """Load ``weights``, run one forward/backward over the global batch and one Adam step.

    Adam's first step is lr * g / (|g| + eps): with eps=1e-6 a rounding-level difference in a
    near-zero gradient moves a parameter by at most ~lr * 1e-9 / eps, well inside the tolerance.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict, load_global_state_dict

    layout = setup_megatron(tensor_parallel=tp, pipeline_parallel=pp, seed=5)
    config = transformer_config(model_config, tensor_parallel=tp, pipeline_parallel=pp, calculate_per_token_loss=True)
    model = build_gpt_model(model_config, config)
    load_global_state_dict(model, weights)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, adam_eps=1e-6, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer
        ),
        [ddp],
    )
    tokens, labels, mask = _batch()
    per_rank = GLOBAL_BATCH // layout.data_parallel
    rows = range(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    micro_batches = iter([r for r in rows])

    def forward_step(data_iterator, model):
        row = next(data_iterator)
        t, lab, m = tokens[row : row + 1], labels[row : row + 1], mask[row : row + 1]
        position_ids = torch.arange(SEQ).unsqueeze(0)
        output = model(t, position_ids, None, labels=lab)

        def loss_func(per_token_loss):
            total = (per_token_loss.float() * m).sum()
            count = m.sum().to(torch.int)
            return total, count, {"loss": torch.stack([total.detach(), count.float()])}

        return output, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro_batches,
        model=[ddp],
        num_microbatches=per_rank,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    stats = torch.zeros(2)
    for report in reports:
        stats += report["loss"]
    if ps.is_pipeline_last_stage():
        torch.distributed.all_reduce(stats, group=ps.get_data_parallel_group())
    else:
        stats.zero_()
    torch.distributed.all_reduce(stats, group=ps.get_pipeline_model_parallel_group())
    return {"loss": (stats[0] / stats[1]).item(), "grad_norm": grad_norm, "params": gather_full_state_dict(ddp)}


@pytest.fixture(scope="module")
def reference():
    weights = run_distributed(_reference_weights, 1, MODEL)[0]
    single = run_distributed(_train_one_step, 1, 1, 1, MODEL, weights, False)[0]
    return weights, single


LAYOUTS = [
    pytest.param(2, 1, 2, id="TP2"),
    pytest.param(1, 2, 2, id="PP2"),
    pytest.param(1, 1, 2, id="DP2"),
    pytest.param(2, 2, 4, id="TP2xPP2"),
]


@pytest.mark.parametrize("tp,pp,world", LAYOUTS)
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain-opt", "dist-opt"])
def test_layout_matches_single_process(reference, tp, pp, world, distributed_optimizer):
    weights, single = reference
    results = run_distributed(_train_one_step, world, tp, pp, MODEL, weights, distributed_optimizer)
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(single["loss"], abs=1e-5), f"rank {rank} loss"
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], abs=1e-5), f"rank {rank} grad norm"
        assert result["params"].keys() == single["params"].keys()
        for name, value in single["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)
    # The step really moved the weights (the comparison above would be vacuous otherwise).
    moved = max((single["params"][n] - w).abs().max().item() for n, w in weights.items())
    assert moved > 1e-4


def _stream_to_rank0(rank, world, tp, pp, model_config):
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict, iter_model_tensors_to_rank0

    setup_megatron(tensor_parallel=tp, pipeline_parallel=pp, seed=3)
    model = build_gpt_model(model_config, transformer_config(model_config, tensor_parallel=tp, pipeline_parallel=pp))
    streamed = [(name, tensor.clone()) for name, tensor in iter_model_tensors_to_rank0(model)]
    return streamed, gather_full_state_dict(model)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_stream_reaches_rank0_whole(tied):
    import dataclasses

    model_config = dataclasses.replace(MODEL, tie_word_embeddings=tied)
    results = run_distributed(_stream_to_rank0, 4, 2, 2, model_config)
    streamed, full = results[0]
    names = [name for name, _ in streamed]
    assert len(names) == len(set(names)) and set(names) == set(full)  # every tensor once
    for name, tensor in streamed:
        torch.testing.assert_close(tensor, full[name], atol=0, rtol=0, msg=name)
    assert all(not r[0] for r in results[1:])  # only rank 0 receives
