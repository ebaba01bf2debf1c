"""Move whole (unsharded) Megatron-layout weights into and out of this rank's TP/PP shard.

The *global* state dict uses megatron-core's local-spec parameter names with global layer indices
(``decoder.layers.{i}.self_attention.linear_qkv.weight``, ``embedding.word_embeddings.weight``,
...) and TP=1 shapes (padded vocabulary included). How a tensor is split across tensor-parallel
ranks is read from the attributes megatron-core sets on every parameter (``tensor_model_parallel``,
``partition_dim``); what each rank's shard stacks is megatron's fixed convention, decided here by
name and config (:func:`tp_blocks`), never by ``partition_stride`` (Transformer Engine's layers may
leave it at 1): SwiGLU's fused fc1 on rank r holds [gate_r; up_r] (megatron's MLP chunks its
local output in two), and the fused QKV on rank r holds its whole query groups, each interleaved
[q heads; k; v], which is one contiguous slice of the global per-group layout. Vocabulary tensors hold the
true vocabulary in the global dict: they are zero-padded to Megatron's padded size (which depends on
TP) on load and trimmed on gather, so one global dict fits every layout.

Mixture-of-experts layers: expert e of a layer is ``decoder.layers.{i}.mlp.experts.local_experts.{e}.*``
with its *global* index e, whichever expert-parallel (EP) rank holds it and whatever the expert
module (megatron's SequentialMLP numbers its experts locally; Transformer Engine's grouped MLP names
them ``linear_fc1.weight{j}``). Expert tensors are split over the expert-tensor-parallel group,
not the TP group, and each EP rank holds only its own experts: walks over one rank's parameters
cover its experts; :func:`gather_full_state_dict` and :func:`iter_model_tensors_to_rank0` collect
every EP rank's.

LoRA adapters (:mod:`megatron_zcpo.megatron.lora`) are not part of the base's walks: the base's
tensors keep their names and are, with ``merged``, streamed as W + (alpha/r) B A; the adapters
themselves are the part "adapters" (``...linear_qkv_lora.lora_a`` / ``.lora_b``, split over TP like
their partitioned matrix, fc1's B as [gate; up] like fc1's weight).
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.megatron.lora import is_adapter_name, lora_adapters
from megatron_zcpo.utils.devices import compute_device
from megatron_zcpo.utils.runtime import unwrap

# Transformer Engine fuses the pre-norms into the following linear; the global names are local-spec.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    # multi-latent attention: TE fuses the latent norms into the up-projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
# The routers' load-balancing correction bias (DeepSeek-V3's e_score_correction_bias): a float32
# buffer megatron-core keeps (and may update) outside the optimizer, but a weight of the model.
EXPERT_BIAS_SUFFIX = "router.expert_bias"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # megatron's SequentialMLP
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP
PARTS = ("all", "dense", "experts", "adapters")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_TENSORS = (EMBEDDING, TIED_OUTPUT)


def _layer_offset(model) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config)


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Global parameter name of a local one: global layer index, local-spec norm names, global
    expert index (this EP rank's first expert is ``expert_offset``)."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    index, rest = int(match.group(1)), match.group(2)
    rest = _TE_TO_LOCAL.get(rest, rest)
    expert = _LOCAL_EXPERT.match(rest)
    grouped = _TE_GROUPED_EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}"
    elif grouped:
        rest = f"mlp.experts.local_experts.{int(grouped.group(2)) + expert_offset}.{grouped.group(1)}.weight"
    return f"decoder.layers.{index + layer_offset}.{rest}"


def is_expert_tensor(name: str) -> bool:
    """Whether the global tensor ``name`` belongs to a routed expert (held by one EP rank)."""
    return ".mlp.experts." in name


def _expert_offset(model) -> int:
    from megatron.core import parallel_state as ps

    experts = unwrap(model).config.num_moe_experts
    if not experts:
        return 0
    return ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())


def _split_group(name: str):
    """(rank, size, group) of the group ``name`` is split over: expert-tensor-parallel for experts, else TP."""
    from megatron.core import parallel_state as ps

    if is_expert_tensor(name):
        return (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def named_global_parameters(model, adapters: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(global_name, local_parameter)`` for this rank's stage of a GPTModel (DDP-wrapped ok):
    the base's parameters and the routers' correction-bias buffers (``...mlp.router.expert_bias``,
    float32 [experts]: weights of the model that the optimizer does not own), or with ``adapters``
    its LoRA adapters' instead.

    With tied embeddings, the last pipeline stage's copy of the embedding (``output_layer.weight``)
    is reported under the embedding's global name. Experts carry their global index.
    """
    model = unwrap(model)
    offset, expert_offset = _layer_offset(model), _expert_offset(model)
    biases = [(name, buffer) for name, buffer in model.named_buffers() if name.endswith(EXPERT_BIAS_SUFFIX)]
    for name, param in list(model.named_parameters()) + biases:
        if is_adapter_name(name) != adapters:
            continue
        name = global_name(name, offset, expert_offset)
        if name == TIED_OUTPUT and getattr(model, "share_embeddings_and_output_weights", False):
            name = EMBEDDING
        yield name, param


def tp_blocks(name: str, config) -> int:
    """How many blocks the global tensor ``name`` stacks along its partition dimension, each split
    over the TP ranks on its own: 2 for SwiGLU's fc1 [gate; up] (and its adapter's B) when
    ``config.gated_linear_unit`` (rank r holds [gate_r; up_r]), else 1 (a rank holds one contiguous slice)."""
    return 2 if config.gated_linear_unit and name.rsplit(".", 2)[-2] in ("linear_fc1", "linear_fc1_lora") else 1


def _tp_split(global_tensor: torch.Tensor, param, blocks: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return global_tensor
    dim = param.partition_dim
    size = global_tensor.shape[dim]
    if size % (blocks * tp_size):
        raise ValueError(f"dimension {dim} of size {size} does not split into {blocks}x{tp_size} parts")
    return torch.cat(
        [block.chunk(tp_size, dim=dim)[tp_rank] for block in global_tensor.chunk(blocks, dim=dim)], dim=dim
    )


def _tp_merge(shards, param, blocks: int) -> torch.Tensor:
    dim = param.partition_dim
    pieces = [shard.chunk(blocks, dim=dim) for shard in shards]
    return torch.cat([torch.cat([p[b] for p in pieces], dim=dim) for b in range(blocks)], dim=dim)


def _true_vocab_size(model) -> Optional[int]:
    config = getattr(unwrap(model), "zcpo_model_config", None)
    return None if config is None else config.vocab_size


def _pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if tensor.shape[0] >= padded_rows:
        return tensor
    pad = tensor.new_zeros((padded_rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


@torch.no_grad()
def load_global_state_dict(
    model, state_dict: Dict[str, torch.Tensor], strict: bool = True, adapters: bool = False
) -> None:
    """Copy this rank's shard of every parameter (with ``adapters``: every LoRA adapter's instead)
    from a global (TP=1, all layers) state dict.

    Raises ``KeyError`` naming the parameter when ``strict`` and one is missing, and
    ``ValueError`` naming it when a shape does not match.
    """
    config = unwrap(model).config
    for name, param in named_global_parameters(model, adapters):
        tp_rank, tp_size, _ = _split_group(name)
        if name not in state_dict:
            if strict:
                raise KeyError(f"global state dict has no tensor {name!r}")
            continue
        tensor = state_dict[name]
        if name in VOCAB_TENSORS:
            sharded = getattr(param, "tensor_model_parallel", False)
            tensor = _pad_vocab(tensor, param.shape[0] * (tp_size if sharded else 1))
        shard = _tp_split(tensor, param, tp_blocks(name, config), tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: shard shape {tuple(shard.shape)} (global {tuple(state_dict[name].shape)}) "
                f"does not match the parameter's {tuple(param.shape)}"
            )
        if name.endswith(EXPERT_BIAS_SUFFIX):  # float32 whatever the module's dtype, as megatron-core keeps it
            param.data = shard.to(device=param.device, dtype=torch.float32).clone()
        else:
            param.copy_(shard.to(param.dtype))


@contextlib.contextmanager
def expert_biases_kept_in_float32(*models) -> Iterator[None]:
    """Around a cast of whole models to 16 bits (megatron's ``Float16Module`` casts buffers too):
    the routers' correction biases come back float32 with their exact values (megatron-core
    restores the dtype only at the next forward, from the rounded values; a rounded bias moves
    tokens near a tie to other experts). A model may be None (a LoRA run has no reference)."""
    routers = [
        (module, module.expert_bias.detach().clone())
        for model in models
        if model is not None
        for module in unwrap(model).modules()
        if getattr(module, "expert_bias", None) is not None
    ]
    yield
    for module, bias in routers:
        module.expert_bias.data = bias


def _in_part(name: str, part: str) -> bool:
    if part not in PARTS:
        raise ValueError(f"part={part!r}: choose one of {PARTS}")
    return part in ("all", "adapters") or (part == "experts") == is_expert_tensor(name)


@torch.no_grad()
def iter_global_tensors(model, part: str = "all", merged: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters one at a time, gathered across tensor-parallel ranks.

    Yields ``(global_name, tensor)`` with TP=1 shapes and the true vocabulary, on the
    parameters' device, so a consumer (the rollout weight push) holds one full tensor at a time.
    ``part``: "all", "dense" (everything but the routed experts), "experts" (this EP rank's) or
    "adapters" (the LoRA adapters alone). ``merged``: a LoRA-adapted linear's weight is W +
    (alpha/r) B A (each rank merges its shard in fp32, cast to W's dtype; the parameters are not
    touched). Collective over the TP group (dense tensors) and the expert-tensor-parallel group
    (experts): every rank of those groups must consume the whole stream.
    """
    import torch.distributed as dist

    vocab_size, config = _true_vocab_size(model), unwrap(model).config
    adapter_of = {id(adapter.base.weight): adapter for adapter in lora_adapters(model)} if merged else {}
    for name, param in named_global_parameters(model, adapters=part == "adapters"):
        if not _in_part(name, part):
            continue
        adapter = adapter_of.get(id(param))
        tensor = param.detach() if adapter is None else adapter.merged_weight()
        if name.endswith(EXPERT_BIAS_SUFFIX):
            tensor = tensor.float()
        _, tp_size, group = _split_group(name)
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=group)
            tensor = _tp_merge(shards, param, tp_blocks(name, config))
        if name in VOCAB_TENSORS and vocab_size is not None:
            tensor = tensor[:vocab_size]
        yield name, tensor


def iter_stage_tensors(model, part: str = "all", merged: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """:func:`iter_global_tensors` of this pipeline stage, without the last stage's copy of a
    tied embedding (the first stage sends it), so the stages' streams (and, for the experts,
    each EP rank's) together hold every tensor of the model exactly once. Collective as
    :func:`iter_global_tensors`."""
    from megatron.core import parallel_state as ps

    later_stage = ps.get_pipeline_model_parallel_rank() > 0
    for name, tensor in iter_global_tensors(model, part, merged):
        if later_stage and name == EMBEDDING:
            continue
        yield name, tensor


def is_stage_lead() -> bool:
    """Whether this rank sends its pipeline stage's dense weights: TP, CP and DP rank 0."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def walks_dense_part() -> bool:
    """Whether this rank takes part in its stage's dense walk (the first replica: DP and CP rank 0)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def walks_expert_part(model) -> bool:
    """Whether this rank takes part in the walk over its EP rank's experts (the first expert
    replica: expert-data-parallel rank 0); False for a model without experts."""
    from megatron.core import parallel_state as ps

    return bool(unwrap(model).config.num_moe_experts) and ps.get_expert_data_parallel_rank() == 0


def is_expert_shard_lead(model) -> bool:
    """Whether this rank sends its EP rank's experts of its stage: expert-tensor-parallel rank 0 of
    the first expert replica (False without experts)."""
    from megatron.core import parallel_state as ps

    return walks_expert_part(model) and ps.get_expert_tensor_parallel_rank() == 0


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` back to back in one uint8 tensor [sum of nbytes] (the layout of
    SGLang's flattened weight buckets). Raises ``ValueError`` when a tensor would start at a byte
    offset its dtype cannot be viewed at (the receiver views the buffer without copying)."""
    offset = 0
    for tensor in tensors:
        if offset % tensor.element_size():
            raise ValueError(
                f"a {tensor.dtype} tensor would start at byte {offset} of the flat buffer, "
                f"not a multiple of {tensor.element_size()}"
            )
        offset += tensor.numel() * tensor.element_size()
    return torch.cat([tensor.contiguous().reshape(-1).view(torch.uint8) for tensor in tensors])


def unflatten_tensors(flat: torch.Tensor, metadata: Sequence[Tuple[Sequence[int], torch.dtype]]) -> List[torch.Tensor]:
    """Views into ``flat`` (uint8 [N]) of the tensors :func:`flatten_tensors` packed, given their
    (shape, dtype) in order; raises ``ValueError`` when the sizes do not add up to N."""
    out, offset = [], 0
    for shape, dtype in metadata:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(flat[offset : offset + nbytes].view(dtype).view(tuple(shape)))
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"flat buffer of {flat.numel()} bytes, metadata describe {offset}")
    return out


def no_partner(name: str) -> Optional[str]:
    """No tensor must share a bucket with ``name`` (the default of :func:`bucket_tensors`)."""
    return None


def bucket_tensors(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    bucket_bytes: int,
    partner_of: Callable[[str], Optional[str]] = no_partner,
) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of at most ``bucket_bytes`` (a bigger tensor goes
    alone), never closing a list while a tensor named by ``partner_of`` of one in it (a later one of
    the stream that must arrive with it) is still to come: that list grows past the limit."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: List[Tuple[str, torch.Tensor]] = []
    size, awaited = 0, set()
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and not awaited:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        awaited.discard(name)
        partner = partner_of(name)
        if partner is not None:
            awaited.add(partner)
    if bucket:
        yield bucket


def _send_to_rank0(stream: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    """Send a stream of named tensors to global rank 0 in buckets (metadata, flat bytes), then None."""
    import torch.distributed as dist

    for bucket in bucket_tensors(stream, bucket_bytes):
        dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in bucket]], dst=0)
        dist.send(flatten_tensors([t for _, t in bucket]), dst=0)
    dist.send_object_list([None], dst=0)


def _receive_on_rank0(source: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """On rank 0: the named tensors :func:`_send_to_rank0` sends from global rank ``source``."""
    import torch.distributed as dist

    device = compute_device()
    while True:
        header = [None]
        dist.recv_object_list(header, src=source)
        if header[0] is None:
            return
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in header[0]]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.recv(flat, src=source)
        tensors = unflatten_tensors(flat, [(shape, dtype) for _, shape, dtype in header[0]])
        yield from zip([name for name, _, _ in header[0]], tensors)


def _part_to_rank0(
    model, part: str, walks: bool, sends: bool, source: int, bucket_bytes: int, merged: bool = False
) -> Iterator[Tuple[str, torch.Tensor]]:
    """One share of a stage (its dense tensors or adapters, or one EP rank's experts) on rank 0: the
    ranks that ``walks`` it take part in its gathers, the one that ``sends`` it sends it, rank 0
    yields it (from its own walk when ``source`` is 0)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if walks:
        stream = iter_stage_tensors(model, part, merged)
        if sends and rank == 0:
            yield from stream
        elif sends:
            _send_to_rank0(stream, bucket_bytes)
        else:
            for _ in stream:  # this rank's part of the share's gathers
                pass
    if rank == 0 and source != 0:
        yield from _receive_on_rank0(source)


def iter_model_tensors_to_rank0(
    model, bucket_bytes: int = 256 * 2**20, *, merged: bool = False, adapters: bool = False
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The whole model's global tensors, one at a time, on global rank 0; nothing elsewhere.

    For a rollout engine that lives in rank 0's process (the embedded engine). Pipeline stages
    are walked in order, and in each stage its dense share, then each EP rank's experts: the ranks
    of the share's first replica walk :func:`iter_stage_tensors` (TP / expert-TP gathers) and its
    lead (:func:`is_stage_lead`, :func:`is_expert_shard_lead`) sends the tensors to rank 0 in
    buckets of at most ``bucket_bytes`` (one bigger tensor goes alone): per bucket one metadata
    message (names, shapes, dtypes) and one flat byte buffer. Other replicas only wait. No rank
    but 0 holds more than a bucket. ``merged``: LoRA-adapted weights merged (:func:`iter_global_tensors`);
    ``adapters``: the LoRA adapters alone, stage by stage. Collective over all ranks: every rank must
    exhaust the iterator.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp_rank, has_experts = ps.get_pipeline_model_parallel_rank(), bool(unwrap(model).config.num_moe_experts)
    ep_rank = ps.get_expert_model_parallel_rank() if has_experts else 0
    leads = [None] * dist.get_world_size()  # every rank's (stage, EP rank) when it leads a share
    dist.all_gather_object(
        leads,
        (
            (pp_rank, "dense", 0) if is_stage_lead() else None,
            (pp_rank, "experts", ep_rank) if is_expert_shard_lead(model) else None,
        ),
    )
    source = {share: rank for rank, pair in enumerate(leads) for share in pair if share is not None}
    for stage in range(ps.get_pipeline_model_parallel_world_size()):
        here = stage == pp_rank
        yield from _part_to_rank0(
            model,
            "adapters" if adapters else "dense",
            here and walks_dense_part(),
            here and is_stage_lead(),
            source[(stage, "dense", 0)],
            bucket_bytes,
            merged,
        )
        for expert_rank in range(ps.get_expert_model_parallel_world_size() if has_experts and not adapters else 0):
            mine = here and ep_rank == expert_rank
            yield from _part_to_rank0(
                model,
                "experts",
                mine and walks_expert_part(model),
                mine and is_expert_shard_lead(model),
                source[(stage, "experts", expert_rank)],
                bucket_bytes,
            )
        dist.barrier()


def gather_global_state_dict(
    model, dtype: Optional[torch.dtype] = None, part: str = "all", merged: bool = False
) -> Dict[str, torch.Tensor]:
    """This pipeline stage's parameters (``part``, ``merged``: see :func:`iter_global_tensors`),
    gathered across tensor-parallel ranks, by global name.

    Collective over the TP group (every TP rank must call it). Returns CPU tensors. To get the
    whole model, merge the dicts of all pipeline stages (see :func:`gather_full_state_dict`).
    """
    return {
        name: tensor.to(dtype or tensor.dtype).cpu().clone()
        for name, tensor in iter_global_tensors(model, part, merged)
    }


def gather_full_state_dict(
    model, dtype: Optional[torch.dtype] = None, part: str = "all", merged: bool = False
) -> Dict[str, torch.Tensor]:
    """The whole model's global state dict (``part``, ``merged``: see :func:`iter_global_tensors`), on
    every rank of the model-parallel group (tests, export).

    Collective over the TP, expert-parallel and PP groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = gather_global_state_dict(model, dtype, part, merged)
    if unwrap(model).config.num_moe_experts and ps.get_expert_model_parallel_world_size() > 1:
        shards = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(
            shards, {n: t for n, t in local.items() if is_expert_tensor(n)}, group=ps.get_expert_model_parallel_group()
        )
        for shard in shards:
            local.update(shard)
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return local
    stages = [None] * pp_size
    dist.all_gather_object(stages, local, group=ps.get_pipeline_model_parallel_group())
    whole: Dict[str, torch.Tensor] = {}
    for stage in stages:
        whole.update(stage)
    return whole
