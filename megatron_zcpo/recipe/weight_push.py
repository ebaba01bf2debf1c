"""The recipe's weight push: the policy's weights, converted to Hugging Face names, into the rollout engine.

Two ways, chosen at start-up by :func:`stage_weight_push`: one sender (no pipeline parallelism, or
the embedded engine, which lives in global rank 0's process: every stage streams to rank 0), or per
stage (SGLang under pipeline parallelism: each stage's lead pushes its own share through its own
weight-update group, and nothing funnels through rank 0). The stages push one after another: an
SGLang server serves weight updates one at a time and a group's first broadcast waits for all
its members, so two stages pushing at once deadlock as soon as two servers take them in opposite
orders (see :mod:`megatron_zcpo.rollout.sglang_api`); the pushes are bandwidth-bound either way
(one stage's share at a time still leaves every byte on its own stage's link). The engine's
transport (NCCL broadcast or disk, see :mod:`megatron_zcpo.rollout.update_weight`) only sees
streams of (HF name, tensor). Ranks meet rank 0 before and after a push in the
:class:`~megatron_zcpo.recipe.rank0_wait.Rank0Wait` group, never in a training group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class StageWeightPush:
    """Per-stage weight push, present on every rank; ``engine``: this rank's SGLang client for
    its stage's share (stage leads), None on the other ranks (they take part in TP gathers)."""

    engine: Any = None


def stage_weight_push(config, engine, waits) -> Optional[StageWeightPush]:
    """This rank's per-stage weight push (``config``: the RunConfig; ``engine``: rank 0's, None
    elsewhere; ``waits``: the run's Rank0Wait), or None when one sender does (no PP, or the
    embedded engine). Collective.

    Under pipeline parallelism with SGLang every stage's lead (TP, CP and DP rank 0) pushes its
    share through a weight-update group of its own (``<group_name>-pp<stage>``), one stage after
    the other; the servers' addresses and API key come from rank 0's engine.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.weights import is_stage_lead

    if config.rollout.engine != "sglang" or config.parallel.pipeline == 1:
        return None
    servers = waits.broadcast((list(engine.config.server_urls), engine.config.api_key) if dist.get_rank() == 0 else None)
    if not is_stage_lead():
        return StageWeightPush()
    from megatron_zcpo.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

    client = dict(config.rollout.sglang.client, quantization=config.rollout.quantization, api_key=servers[1])
    client["group_name"] = f"{client.get('group_name', SGLangEngineConfig.group_name)}-pp{ps.get_pipeline_model_parallel_rank()}"
    client.update(master_address=None, master_port=None)  # each lead offers its own host's address
    return StageWeightPush(SGLangEngine(SGLangEngineConfig(server_urls=servers[0], **client)))


def push_weights(trainer, engine, version: int, stages: Optional[StageWeightPush] = None, waits=None) -> None:
    """Send ``trainer``'s policy weights to ``engine`` (rank 0's; None elsewhere) as ``version``.

    Collective over all ranks. With ``stages`` (see :func:`stage_weight_push`) each pipeline
    stage's lead converts its stage's TP-gathered tensors to Hugging Face names on the fly (the
    checkpoint converter's mapping) and pushes them itself, stage after stage; rank 0 then has
    the servers serve ``version``. Without it every stage streams its tensors to global rank 0,
    which converts them and feeds the engine. No rank holds more than one full tensor (plus a
    bucket). ``waits`` (the run's :class:`~megatron_zcpo.recipe.rank0_wait.Rank0Wait`; None: the
    default group) is where the ranks meet rank 0 first (it may still be
    generating, with overlapped rollouts), between two stages and after rank 0's commit.
    """
    import torch.distributed as dist

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0, iter_stage_tensors

    if waits is None:
        from megatron_zcpo.recipe.rank0_wait import Rank0Wait

        waits = Rank0Wait(None)
    rank = dist.get_rank()
    waits.barrier()
    if stages is None:
        stream = iter_model_tensors_to_rank0(trainer.policy)
        if rank == 0:
            engine.update_weights(megatron_to_hf_stream(stream, trainer.model_config), version)
        else:
            for _ in stream:  # collective: every rank walks its part
                pass
        waits.barrier()
        return
    from megatron.core import parallel_state as ps

    weight_map = None
    pushing = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    for stage in range(ps.get_pipeline_model_parallel_world_size()):
        if stage > 0:
            waits.barrier()  # the previous stage's push is complete on every server
        if pushing and stage == ps.get_pipeline_model_parallel_rank():
            stream = megatron_to_hf_stream(iter_stage_tensors(trainer.policy), trainer.model_config)
            if stages.engine is not None:
                weight_map = stages.engine.push_part(stream, version, file_prefix=f"model-pp{stage}")
            else:
                for _ in stream:  # this TP rank's part of the stage's gathers
                    pass
    weight_maps = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(weight_map, weight_maps, dst=0, group=waits.group)
    if rank == 0:
        engine.commit_weights(version, weight_maps)
    waits.barrier()
