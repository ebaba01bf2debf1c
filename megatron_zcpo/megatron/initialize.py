"""One entry point that brings up torch.distributed, megatron-core's parallel state and RNG."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_zcpo.utils.devices import has_cuda, local_cuda_device
from megatron_zcpo.utils.runtime import free_port


@dataclass(frozen=True)
class ParallelLayout:
    """This process's place in the (TP, PP, CP, DP) grid once :func:`setup_megatron` ran."""

    world_size: int
    rank: int
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    data_parallel: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int


def distributed_env_from_slurm(environ=None) -> bool:
    """Fill torchrun's variables from Slurm's when this process was started by ``srun``.

    RANK/WORLD_SIZE/LOCAL_RANK come from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR
    from the first host of SLURM_JOB_NODELIST (or SLURM_NODELIST) and MASTER_PORT from
    ``ZCPO_MASTER_PORT`` or a port derived from the job id, so every task of the job agrees
    without talking first. Variables already set win. Returns True when Slurm's were used.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env or "RANK" in env or "SLURM_NTASKS" not in env:
        return False
    from megatron_zcpo.utils.slurm import expand_slurm_nodelist

    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault(
        "MASTER_ADDR", expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost")))[0]
    )
    env.setdefault("MASTER_PORT", env.get("ZCPO_MASTER_PORT", str(job_master_port(int(env.get("SLURM_JOB_ID", "0"))))))
    return True


def job_master_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id``'s training tasks: 20000-28999, below the SGLang
    router's 29000 and servers' 30000+ (examples/common/sglang_node.py), which share the first
    training node in colocated placement, and below Linux's ephemeral ports (32768+)."""
    return 20000 + job_id % 9000


def _init_process_group(timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # torchrun / srun (through our launcher) set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
        os.environ.setdefault("LOCAL_RANK", "0")
    backend = "nccl" if has_cuda() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_cuda_device(int(os.environ.get("LOCAL_RANK", 0))))
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and, when present, CUDA) generators."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def setup_megatron(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    seed: int = 1234,
    *,
    collective_timeout_s: float = 1800.0,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
) -> ParallelLayout:
    """Set up everything megatron-core needs in this process and return its place in the grid.

    torch.distributed comes from torchrun's (or srun-derived) environment, or a single local
    process when none is set; backend NCCL on GPUs, gloo otherwise. Then the CPU platform layer
    (no-op with CUDA), megatron-core's ``parallel_state`` at (TP, PP, CP) with DP = world / (TP*PP*CP),
    and the model-parallel RNG trackers seeded from ``seed``. Mixture-of-experts models add
    megatron's expert groups: ``expert_parallel`` (EP) x ``expert_tensor_parallel`` (ETP, None: as
    TP) ranks inside each pipeline stage's TP * CP * DP ranks. Calling it again with the same layout
    is a no-op; with a different layout it tears the old one down first.

    ``collective_timeout_s`` (``parallel.collective_timeout_s``) bounds every collective of the
    default group and of megatron-core's groups: past it gloo raises, and NCCL's watchdog tears the
    process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3). A rank that waits longer for
    another (rank 0's rollouts) must wait elsewhere: :mod:`megatron_zcpo.recipe.rank0_wait`.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mp_tensor_parallel

    from megatron_zcpo.megatron import platform

    _init_process_group(collective_timeout_s)
    platform.activate()
    world = dist.get_world_size()
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel*pipeline_parallel*context_parallel"
            f" = {tensor_parallel}*{pipeline_parallel}*{context_parallel}"
        )
    expert_grid = expert_parallel * (expert_tensor_parallel or tensor_parallel) * pipeline_parallel
    if world % expert_grid:
        raise ValueError(
            f"world size {world} is not divisible by expert_parallel*expert_tensor_parallel*"
            f"pipeline_parallel = {expert_parallel}*{expert_tensor_parallel or tensor_parallel}*{pipeline_parallel}"
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
            and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel
            and parallel_state.get_context_parallel_world_size() == context_parallel
            and parallel_state.get_expert_model_parallel_world_size() == expert_parallel
            and parallel_state.get_expert_tensor_parallel_world_size() == (expert_tensor_parallel or tensor_parallel)
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            context_parallel_size=context_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
            distributed_timeout_minutes=collective_timeout_s / 60,  # megatron-core makes a timedelta of it
        )
    seed_everything(seed)
    mp_tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return current_layout()


def current_layout() -> ParallelLayout:
    """The :class:`ParallelLayout` of this process (after :func:`setup_megatron`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        context_parallel=ps.get_context_parallel_world_size(),
        data_parallel=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )
