"""The mixture-of-experts rows of the calibration (issue 44; :mod:`megatron_zcpo.planning.calibration`
predicts them and holds them within its band): NeMo-RL's DeepSeek-V3 and Qwen3-235B-A22B RL steps (v0.5 and
v0.4) and its Qwen3-30B-A3B step, its published DeepSeek-V3 refit (the CUDA IPC push is fitted on it and
the Llama-3.1-70B refit), megatron-core's published Qwen3-235B pre-training step (the MoE training MFU
is fitted on it) and SGLang's published DeepSeek-V3 decode step (a check of the decode model on an MoE
server with EP, DP attention and two-batch overlap; FP8 weights read at 1 byte)."""

from __future__ import annotations

from typing import List

from megatron_zcpo.planning.memory_model import Layout
from megatron_zcpo.planning.published import NEMO_RL_V04, PublishedRun, nemo_run

# Mixture-of-experts rows (issue 44). NeMo-RL's DeepSeek-V3 and Qwen3-235B runs generate 512 samples
# with sequences up to 1,536 / 8,192 tokens; their layouts' uneven pipeline stages (61 = 3 + 14 x 4 + 2,
# 94 = 11 + 6 x 12 + 11) are assumed, and expert tensor parallelism 1 where EP x TP would exceed a stage.
# Read from the recipes of both releases (examples/configs/recipes/llm/performance/, r0.4.0 and r0.5.0):
# DeepSeek-V3 and Qwen3-235B train with `activation_checkpointing: true` (full recompute), and every
# 1-step-off run's generation servers take `gpu_memory_utilization: 0.8`.
_DSV3 = Layout(
    tensor_parallel=1,
    pipeline_parallel=16,
    data_parallel=16,
    expert_parallel=16,
    recompute="full",
    first_stage_layers=3,
    last_stage_layers=2,
)
_Q235_ON = Layout(
    tensor_parallel=2,
    context_parallel=2,
    pipeline_parallel=8,
    data_parallel=4,
    expert_parallel=16,
    expert_tensor_parallel=1,
    recompute="full",
    first_stage_layers=11,
    last_stage_layers=11,
)
_Q235_OFF = Layout(
    tensor_parallel=4,
    pipeline_parallel=8,
    data_parallel=4,
    expert_parallel=16,
    expert_tensor_parallel=1,
    recompute="full",
    first_stage_layers=11,
    last_stage_layers=11,
)
_DS = dict(samples=512, max_sequence=1536)
_Q235 = dict(samples=512, max_sequence=8192)
_OFF = dict(overlap=True, mem_fraction=0.8)
MOE_RUNS: List[PublishedRun] = [
    PublishedRun(
        "Qwen3-235B-A22B pre-training step, 256 GPUs",
        "megatron-core MoE model zoo (Megatron-MoE-ModelZoo, Qwen3 best practice: H100 BF16, all-to-all "
        "dispatcher, 24.2 s, 200 TFLOP/s per GPU)",
        "Qwen3-235B-A22B",
        "train",
        24.2,
        gpus=256,
        layout=Layout(
            tensor_parallel=2,
            pipeline_parallel=32,
            virtual_pipeline=3,
            data_parallel=4,
            expert_parallel=8,
            expert_tensor_parallel=1,
            recompute="selective",
        ),
        samples=2048,
        max_sequence=4096,
        fitted="the MoE training MFU (0.222; the step's all-to-alls over NVLink counted apart)",
    ),
    PublishedRun(
        "DeepSeek-V3 decode step, 72 GPUs",
        "SGLang team, lmsys.org 2025-05-05 (large-scale EP: 22,282 output tokens/s per node of 8 H100, 256 "
        "sequences per GPU, KV cache 2,000 tokens, FP8 weights, DP attention, EP72, two-batch overlap)",
        "DeepSeek-V3",
        "decode",
        256 / (22282 / 8),
        generation_tp=72,
        dp_attention=72,
        samples=256 * 72,
        mean_sequence=2000,
        weight_bytes=1.0,
        two_batch_overlap=True,
    ),
    PublishedRun(
        "DeepSeek-V3 refit, NeMo-RL v0.3",
        'NeMo-RL refit blog, 2025-08-12 ("Journey of Optimizing Weight Transfer in Large MoE Models by 10x", '
        "Table 1: 47.2 s; training EP64 x PP8, generation TP64, colocated)",
        "DeepSeek-V3",
        "refit",
        47.2,
        fitted="the CUDA IPC rate and fixed part (with the Llama-3.1-70B refit)",
    ),
    nemo_run("DeepSeek-V3 GRPO on-policy, 256 GPUs", "DeepSeek-V3", 134.0, 12.7, 256, 32, _DSV3, 744, **_DS),
    nemo_run(
        "DeepSeek-V3 GRPO 1-step off-policy, 512 GPUs",
        "DeepSeek-V3",
        64.9,
        13.1,
        256,
        32,
        _DSV3,
        738,
        rollout_gpus=256,
        **_DS,
        **_OFF,
    ),
    nemo_run(
        "Qwen3-235B-A22B GRPO on-policy, 128 GPUs",
        "Qwen3-235B-A22B",
        431.0,
        54.1,
        128,
        16,
        _Q235_ON,
        5700,
        fitted="the cross-node all-reduce of a decode step (two per layer, TP16 servers spanning two nodes)",
        **_Q235,
    ),
    nemo_run(
        "Qwen3-235B-A22B GRPO 1-step off-policy, 256 GPUs",
        "Qwen3-235B-A22B",
        203.0,
        58.7,
        128,
        8,
        _Q235_OFF,
        5707,
        rollout_gpus=128,
        **_Q235,
        **_OFF,
    ),
    nemo_run(
        "Qwen3-30B-A3B GRPO 1-step off-policy, 32 GPUs",
        "Qwen3-30B-A3B",
        154.0,
        1391.0,
        16,
        2,
        Layout(tensor_parallel=1, pipeline_parallel=2, data_parallel=8, expert_parallel=8, recompute="none"),
        3201,
        rollout_gpus=16,
        **_OFF,
    ),
    nemo_run(
        "v0.4: DeepSeek-V3 GRPO on-policy, 256 GPUs",
        "DeepSeek-V3",
        154.0,
        11.0,
        256,
        32,
        _DSV3,
        745,
        source=NEMO_RL_V04,
        **_DS,
    ),
    nemo_run(
        "v0.4: DeepSeek-V3 GRPO 1-step off-policy, 512 GPUs",
        "DeepSeek-V3",
        77.9,
        11.0,
        256,
        32,
        _DSV3,
        744,
        rollout_gpus=256,
        source=NEMO_RL_V04,
        **_DS,
        **_OFF,
    ),
    nemo_run(
        "v0.4: Qwen3-235B-A22B GRPO on-policy, 128 GPUs",
        "Qwen3-235B-A22B",
        506.0,
        45.7,
        128,
        16,
        _Q235_ON,
        5671,
        source=NEMO_RL_V04,
        **_Q235,
    ),
    nemo_run(
        "v0.4: Qwen3-235B-A22B GRPO 1-step off-policy, 256 GPUs",
        "Qwen3-235B-A22B",
        241.0,
        52.2,
        128,
        8,
        _Q235_OFF,
        5691,
        rollout_gpus=128,
        source=NEMO_RL_V04,
        **_Q235,
        **_OFF,
    ),
]
