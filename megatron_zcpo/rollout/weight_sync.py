"""Weight-update group helpers (trainer and server side), tensor bucketing and HF weight streaming."""

from __future__ import annotations

import datetime
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.megatron.weights import unflatten_tensors


def iter_hf_weights(model, model_config, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's weights as ``(hf_name, tensor)``, converted on the fly by the checkpoint converter.

    Each gathered Megatron tensor goes through
    :func:`megatron_zcpo.convert.mapping.megatron_to_hf_tensors` (the same code the
    checkpoint tools use), optionally cast to ``dtype``. Collective over the TP group.
    """
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_global_tensors

    return megatron_to_hf_stream(iter_global_tensors(model), model_config, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as SGLang's weight-update requests spell it ("bfloat16"; ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
):
    """Join a process group outside the default one (the trainer-to-SGLang weight-update group).

    Both sides (the trainer as rank 0, each SGLang server's TP ranks after it) meet at a TCP
    store on ``master_address:master_port`` whose keys are prefixed with ``group_name``; this is
    the rendezvous SGLang's ``/init_weights_update_group`` performs, so the group interoperates
    with it. The group is registered with torch.distributed so ``dist.broadcast(..., group=pg)``
    works; blocks until all ``world_size`` members joined.
    """
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # The TCP store directly, not c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE) the
    # latter would connect to the launcher's store instead of serving this group's on rank 0.
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    helper_args = inspect.signature(c10d._new_process_group_helper).parameters
    # torch renamed pg_options to backend_options (2.6); both default to None.
    options = {"backend_options": None} if "backend_options" in helper_args else {"pg_options": None}
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        **options,
    )
    # Group rank == "global" rank within this private world (what broadcast's src refers to).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def start_broadcast(
    bucket: Sequence[Tuple[str, torch.Tensor]], group, src: int = 0, flat: Optional[torch.Tensor] = None
) -> list:
    """Start sending ``bucket`` from rank ``src`` of ``group``: each tensor in order (SGLang
    receives them so), or ``flat`` (the bucket's :func:`flatten_tensors`) as one broadcast, SGLang's
    ``load_format="flattened_bucket"``. Returns the async work handles to wait on; the caller
    keeps ``flat`` alive until they complete."""
    import torch.distributed as dist

    tensors = [flat] if flat is not None else [tensor.contiguous() for _, tensor in bucket]
    return [dist.broadcast(tensor, src=src, group=group, async_op=True) for tensor in tensors]


def receive_bucket(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group,
    device="cpu",
    src: int = 0,
    flattened: bool = False,
) -> List[Tuple[str, torch.Tensor]]:
    """The receiving side of :func:`start_broadcast` (what an SGLang server does for a bucket)."""
    import torch.distributed as dist

    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"bucket metadata disagree: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    metadata = [(tuple(shape), getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
    if flattened:
        nbytes = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in metadata)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        return list(zip(names, unflatten_tensors(flat, metadata)))
    received = [(n, torch.empty(shape, dtype=dtype, device=device)) for n, (shape, dtype) in zip(names, metadata)]
    handles = [dist.broadcast(tensor, src=src, group=group, async_op=True) for _, tensor in received]
    for handle in handles:
        handle.wait()
    return received
