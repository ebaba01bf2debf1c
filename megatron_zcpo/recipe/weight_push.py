"""The recipe's weight push: the policy's weights, converted to Hugging Face names, into the rollout engine.

Three ways, chosen at start-up by :func:`stage_weight_push`. Colocated SGLang servers fed through
CUDA IPC (``weight_sync: tensor``) are fed from every GPU (:class:`GPUWeightPush`): each rank walks
the whole model in its own replica (TP gathers only: no pipeline or expert parallelism) and hands
the server TP rank on its GPU a handle of its own copy
(:func:`~megatron_zcpo.rollout.sglang.update_weight.tensor_ipc.push_from_every_gpu`). Otherwise one sender (no pipeline or expert
parallelism, or the embedded engine, which lives in global rank 0's process: every stage, and every
expert-parallel rank's experts, stream to rank 0), or per share (SGLang under pipeline or expert
parallelism: each stage's lead pushes its stage's dense tensors, and each expert-parallel rank's
lead its own experts of the stage, through a weight-update group of its own: no rank gathers
another's experts, and nothing funnels through rank 0). The shares push one after another: an
SGLang server serves weight updates one at a time and a group's first broadcast waits for all its
members, so two shares pushing at once deadlock as soon as two servers take them in opposite
orders (see :mod:`megatron_zcpo.rollout.sglang.api`); the pushes are bandwidth-bound either way
(one share at a time still leaves every byte on its own sender's link). The engine's transport
(NCCL broadcast or disk, see :mod:`megatron_zcpo.rollout.sglang.update_weight`) only sees streams of
(HF name, tensor). Every lead pushes to the servers rank 0 has in rotation (it brings healthy lost
ones back first), handed to them before the shares. Ranks meet rank 0 before, between and after the shares in the
:class:`~megatron_zcpo.recipe.rank0_wait.Rank0Wait` group, never in a training group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple, Union


@dataclass
class StageWeightPush:
    """Per-share weight push, present on every rank; ``engine``: this rank's SGLang client for the
    share it sends (stage and expert-shard leads), None on the other ranks (they take part in the
    TP / expert-TP gathers)."""

    engine: Any = None


@dataclass
class GPUWeightPush:
    """The per-GPU push of colocated SGLang servers (``weight_sync: tensor``), present on every rank:
    buckets of ``bucket_bytes``, FP8 weights when ``quantization`` is "fp8"."""

    bucket_bytes: int
    quantization: Optional[str] = None


def share_name(model) -> str:
    """The name of the share this rank sends (``pp<stage>``, ``pp<stage>-ep<rank>`` for an
    expert-parallel rank's experts), or "" when it sends none."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.weights import is_expert_shard_lead, is_stage_lead

    stage = f"pp{ps.get_pipeline_model_parallel_rank()}"
    if is_stage_lead():
        return stage  # the stage's dense tensors, and EP rank 0's experts (the same rank leads both)
    if model is not None and is_expert_shard_lead(model):
        return f"{stage}-ep{ps.get_expert_model_parallel_rank()}"
    return ""


def stage_weight_push(config, engine, waits, model=None) -> Union[StageWeightPush, GPUWeightPush, None]:
    """This rank's per-share weight push (``config``: the RunConfig; ``engine``: rank 0's, None
    elsewhere; ``waits``: the run's Rank0Wait; ``model``: this rank's policy stage), the per-GPU push
    of colocated servers fed through CUDA IPC, or None when one sender does (no PP and no EP, the
    embedded engine, colocated placement through the disk, or LoRA adapters pushed alone). Collective.

    Under pipeline or expert parallelism with SGLang every share's lead (:func:`share_name`) pushes
    it through a weight-update group of its own (``<group_name>-<share>``), one share after the
    other; the servers' addresses and API key come from rank 0's engine.
    """
    import torch.distributed as dist

    if config.rollout.engine != "sglang":
        return None
    if config.model.lora is not None and config.model.lora.push == "adapter":  # adapters only, through rank 0
        return None
    if config.rollout.placement == "colocated":
        from megatron_zcpo.recipe.rollout import colocated_client
        from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig

        client = colocated_client(dict(config.rollout.sglang.client), config)
        if client["weight_sync"] != "tensor":
            return None  # the disk: rank 0 takes the whole model
        return GPUWeightPush(client.get("bucket_bytes", SGLangEngineConfig.bucket_bytes), config.rollout.quantization)
    if config.parallel.pipeline == 1 and config.parallel.expert == 1:
        return None
    servers = waits.broadcast(
        (list(engine.config.server_urls), engine.config.api_key) if dist.get_rank() == 0 else None
    )
    share = share_name(model)
    if not share:
        return StageWeightPush()
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    client = dict(config.rollout.sglang.client, quantization=config.rollout.quantization, api_key=servers[1])
    client["group_name"] = f"{client.get('group_name', SGLangEngineConfig.group_name)}-{share}"
    client.update(master_address=None, master_port=None)  # each lead offers its own host's address
    return StageWeightPush(SGLangEngine(SGLangEngineConfig(server_urls=servers[0], **client)))


def _share_of_turn(model, expert_rank: int, merged: bool = False) -> Iterator[Tuple[str, Any]]:
    """This rank's part of one turn of its stage's push: in turn 0 the dense walk (first replica's
    ranks), then in turn ``e`` the expert walk of expert-parallel rank ``e`` (its first expert
    replica's ranks); yields what this rank sends (its share), drains the rest."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.weights import (
        is_expert_shard_lead,
        is_stage_lead,
        iter_stage_tensors,
        walks_dense_part,
        walks_expert_part,
    )

    walks = [
        (
            "experts",
            walks_expert_part(model) and ps.get_expert_model_parallel_rank() == expert_rank,
            is_expert_shard_lead(model),
        )
    ]
    if expert_rank == 0:
        walks.insert(0, ("dense", walks_dense_part(), is_stage_lead()))
    for part, walks_it, sends_it in walks:
        stream = iter_stage_tensors(model, part, merged) if walks_it else iter(())
        if sends_it:
            yield from stream
        else:
            for _ in stream:  # this rank's part of the share's gathers
                pass


def _counted(stream: Iterator[Tuple[str, Any]], totals: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """``stream`` unchanged, its tensors' bytes added to ``totals["bytes"]``."""
    for name, tensor in stream:
        totals["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def _push_from_every_gpu(
    trainer, engine, version: int, push: GPUWeightPush, waits, merged: bool, totals: Dict[str, int]
) -> None:
    """Every rank converts its replica's whole model (``iter_stage_tensors``: its TP group's gathers; the
    replicas hold the same weights; ``merged``: LoRA-adapted weights merged) and feeds the server TP rank
    on its GPU (global rank = GPU slot); this rank's bytes are added to ``totals``."""
    import torch.distributed as dist

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_stage_tensors
    from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import push_from_every_gpu
    from megatron_zcpo.utils.devices import compute_device

    stream = megatron_to_hf_stream(iter_stage_tensors(trainer.policy, merged=merged), trainer.model_config)
    if push.quantization == "fp8":
        from megatron_zcpo.rollout.quantization import quantize_fp8_hf_weights

        stream = quantize_fp8_hf_weights(stream)
    push_from_every_gpu(
        _counted(stream, totals),
        version,
        engine=engine if dist.get_rank() == 0 else None,
        slot=dist.get_rank(),
        gather=waits.gather,
        broadcast=waits.broadcast,
        bucket_bytes=push.bucket_bytes,
        device=compute_device(),
    )


def push_weights(
    trainer, engine, version: int, stages: Union[StageWeightPush, GPUWeightPush, None] = None, waits=None
) -> Optional[int]:
    """Send ``trainer``'s policy weights to ``engine`` (rank 0's; None elsewhere) as ``version``;
    returns the bytes pushed on rank 0 (None elsewhere).

    Collective over all ranks. With ``stages`` (see :func:`stage_weight_push`) each share's lead
    converts its share's gathered tensors to Hugging Face names on the fly (the checkpoint
    converter's mapping) and pushes them itself, share after share (stage by stage, and within a
    stage expert-parallel rank by rank); rank 0 then has the servers serve ``version``. With a
    :class:`GPUWeightPush` every rank feeds the server TP rank on its own GPU. Without either
    every share streams to global rank 0, which converts it and feeds the engine. No rank holds more
    than one full tensor (plus a bucket). ``waits`` (the run's
    :class:`~megatron_zcpo.recipe.rank0_wait.Rank0Wait`; None: the default group) is where the ranks
    meet rank 0 first (it may still be generating, with overlapped rollouts), between two shares and
    after rank 0's commit.

    A LoRA policy (``model.lora``) pushes W + (alpha/r) B A in place of each adapted weight
    (``push: merged``, merged out of place: the trainer's weights are untouched), or its adapters
    alone as a PEFT adapter (``push: adapter``, stage by stage to rank 0, which has the SGLang
    servers load it under a name of its own per version: :meth:`SGLangEngine.update_adapter`).
    """
    import torch.distributed as dist

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.lora import lora_of
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0

    if waits is None:
        from megatron_zcpo.recipe.rank0_wait import Rank0Wait

        waits = Rank0Wait(None)
    rank = dist.get_rank()
    waits.barrier()
    lora = lora_of(trainer.policy)
    merged, totals = lora is not None, {"bytes": 0}
    if lora is not None and lora.push == "adapter":
        _push_adapter(trainer, engine, version, lora, totals)
        waits.barrier()
        return totals["bytes"] if rank == 0 else None
    if isinstance(stages, GPUWeightPush):
        _push_from_every_gpu(trainer, engine, version, stages, waits, merged, totals)
        waits.barrier()
        return totals["bytes"] if rank == 0 else None
    if stages is None:
        stream = iter_model_tensors_to_rank0(trainer.policy, merged=merged)
        if rank == 0:
            engine.update_weights(_counted(megatron_to_hf_stream(stream, trainer.model_config), totals), version)
        else:
            for _ in stream:  # collective: every rank walks its part
                pass
        waits.barrier()
        return totals["bytes"] if rank == 0 else None
    from megatron.core import parallel_state as ps

    # Every share goes to rank 0's rotation: not to servers it took out, and again to those back.
    rotation = waits.broadcast(engine.rotation_for_push() if rank == 0 else None)
    if stages.engine is not None:
        stages.engine.follow_rotation(rotation)
    weight_map, first = None, True
    my_turn = ps.get_expert_model_parallel_rank()  # the turn whose share this rank sends, if any
    for stage in range(ps.get_pipeline_model_parallel_world_size()):
        for turn in range(ps.get_expert_model_parallel_world_size()):
            if not first:
                waits.barrier()  # the previous share's push is complete on every server
            first = False
            if stage != ps.get_pipeline_model_parallel_rank():
                continue
            stream = megatron_to_hf_stream(_share_of_turn(trainer.policy, turn, merged), trainer.model_config)
            if stages.engine is not None and turn == my_turn:
                weight_map = stages.engine.push_part(
                    _counted(stream, totals), version, file_prefix=f"model-{share_name(trainer.policy)}"
                )
            else:
                for _ in stream:
                    pass
    shares = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((weight_map, totals["bytes"]), shares, dst=0, group=waits.group)
    if rank == 0:
        engine.commit_weights(version, [weight_map for weight_map, _ in shares])
    waits.barrier()
    return sum(count for _, count in shares) if rank == 0 else None


def _push_adapter(trainer, engine, version: int, lora, totals: Dict[str, int]) -> None:
    """``push: adapter``: every stage's adapters to rank 0, which hands them to the engine as a PEFT
    adapter of ``version`` (:mod:`megatron_zcpo.convert.peft`). Collective over all ranks."""
    import torch.distributed as dist

    from megatron_zcpo.convert.peft import megatron_adapters_to_peft_stream, peft_adapter_config
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0

    stream = iter_model_tensors_to_rank0(trainer.policy, adapters=True)
    if dist.get_rank() != 0:
        for _ in stream:  # this rank's part of its stage's gathers
            pass
        return
    base = (trainer.lora_base or {}).get("path")
    peft = _counted(megatron_adapters_to_peft_stream(stream, trainer.model_config), totals)
    engine.update_adapter(peft, peft_adapter_config(lora, base), version)
