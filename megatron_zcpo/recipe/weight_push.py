"""The recipe's weight push: the policy's weights, converted to Hugging Face names, into the rollout engine.

The engine's transport (NCCL broadcast or disk, see :mod:`megatron_zcpo.rollout.update_weight`)
only sees a stream of (HF name, tensor) on global rank 0.
"""

from __future__ import annotations


def push_weights(trainer, engine, version: int) -> None:
    """Send ``trainer``'s policy weights to ``engine`` (rank 0's; None elsewhere) as ``version``.

    Collective over all ranks. Every pipeline stage streams its tensors, TP-gathered one at a
    time, to global rank 0, which converts each to Hugging Face names on the fly (the checkpoint
    converter's mapping) and feeds the engine: no rank holds more than one full tensor (plus the
    engine's bucket).
    """
    import torch.distributed as dist

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0

    stream = iter_model_tensors_to_rank0(trainer.policy)
    if dist.get_rank() == 0:
        engine.update_weights(megatron_to_hf_stream(stream, trainer.model_config), version)
    else:
        for _ in stream:  # collective: every rank walks its part
            pass
    dist.barrier()
