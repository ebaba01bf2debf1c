"""Seconds of the transitions between training and generation: the weight push (NCCL broadcast to
disaggregated servers, CUDA IPC to colocated ones) and the colocated offload / onload.

Pure arithmetic, one set of constants, each with the measurement it is calibrated on:

* NCCL push (disaggregated): ``PUSH_FIXED_S + bytes / PUSH_BYTES_S``: the fixed part is the pause
  and flush of the servers and the set-up of the transfer; the rate folds the trainer's gathers
  (TP / PP / EP shards into full tensors), the name conversion, the bucketing, the broadcast and
  the servers' ``load_weights``. The two constants are fitted on verl's published full NCCL
  broadcasts to disaggregated SGLang: Qwen2.5-32B (2 + 2 nodes) 14-18 s (the midpoint, 16 s, is
  used) and Qwen2.5-72B (4 + 4 nodes) about 29 s: 65.5 and 145.4 GB of bf16 weights give 6.15 GB/s
  and 5.35 s. ``bytes`` is the largest sender's share when pipeline stages push concurrently.
* CUDA IPC push (colocated): every GPU hands its engine the full tensors of its buckets:
  ``IPC_FIXED_S + bytes / IPC_BYTES_S``, both fitted on NeMo-RL's two published colocated refits at
  the ends of the size range: Llama-3.1-70B, 14 s on 64 GPUs (141 GB; the NeMo-RL v0.3 release
  blog's step breakdown), and DeepSeek-V3, 47.2 s (1,342 GB; training EP64 x PP8, generation TP64;
  the NeMo-RL refit blog, "Journey of Optimizing Weight Transfer in Large MoE Models by 10x",
  2025-08-12, Table 1, "NeMo-RL v0.3"): 36.2 GB/s and 10.1 s. The same release blog's smaller
  refits (Llama-3.1-8B 5 s, Qwen3-32B 7 s, Qwen3-30B-A3B 12 s) are overstated by up to 5.5 s by the
  fixed part: they are not held (benchmarks/RESULTS.md).
* Offload / onload (colocated): the trainer's parameters, gradients and optimizer state leave the
  GPU before generation and come back after it, over the host link; the engine's KV pool is freed
  and its weights refilled by the push. ``HOST_LINK_BYTES_S``: PCIe Gen5 x16 of an H100 SXM, 64 GB/s
  per direction nominal, about 50 GB/s reached by pinned copies; not calibrated on a published
  offload timing (none found), so the colocated rows' offload share is the least certain term.
"""

from __future__ import annotations

BF16_BYTES = 2
VERL_QWEN25_32B_PUSH = (2 * 32.76e9, 16.0)  # (bf16 bytes, seconds): 14-18 s published, midpoint
VERL_QWEN25_72B_PUSH = (2 * 72.71e9, 29.0)
PUSH_BYTES_S = (VERL_QWEN25_72B_PUSH[0] - VERL_QWEN25_32B_PUSH[0]) / (VERL_QWEN25_72B_PUSH[1] - VERL_QWEN25_32B_PUSH[1])
PUSH_FIXED_S = VERL_QWEN25_32B_PUSH[1] - VERL_QWEN25_32B_PUSH[0] / PUSH_BYTES_S
NEMO_RL_LLAMA31_70B_REFIT = (2 * 70.55e9, 14.0)  # (bf16 bytes, seconds), colocated, 64 GPUs
NEMO_RL_DEEPSEEK_V3_REFIT = (2 * 671.03e9, 47.2)  # (bf16 bytes, seconds), colocated, EP64 PP8 -> TP64
IPC_BYTES_S = (NEMO_RL_DEEPSEEK_V3_REFIT[0] - NEMO_RL_LLAMA31_70B_REFIT[0]) / (
    NEMO_RL_DEEPSEEK_V3_REFIT[1] - NEMO_RL_LLAMA31_70B_REFIT[1]
)
IPC_FIXED_S = NEMO_RL_LLAMA31_70B_REFIT[1] - NEMO_RL_LLAMA31_70B_REFIT[0] / IPC_BYTES_S
HOST_LINK_BYTES_S = 50e9


def nccl_push_s(sender_bytes: float) -> float:
    """Seconds of a push to disaggregated servers whose largest sender sends ``sender_bytes``."""
    return PUSH_FIXED_S + sender_bytes / PUSH_BYTES_S


def ipc_push_s(model_bytes: float) -> float:
    """Seconds of a push of ``model_bytes`` bf16 bytes to colocated engines through CUDA IPC."""
    return IPC_FIXED_S + model_bytes / IPC_BYTES_S


def offload_onload_s(state_bytes_per_gpu: float) -> float:
    """Seconds to move a GPU's ``state_bytes_per_gpu`` of training state to the host and back."""
    return 2 * state_bytes_per_gpu / HOST_LINK_BYTES_S
