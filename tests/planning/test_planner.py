"""Memory planner: checked against Megatron's published byte counts, Korthikanti et al. and HF sizes."""

import dataclasses
import json

import pytest

from megatron_zcpo.megatron.model import ModelConfig, padded_vocab_size
from megatron_zcpo.planning.memory_model import (
    COMPONENTS,
    GIB,
    KL_FP32_BLOCKS,
    Hardware,
    Layout,
    Workload,
    bytes_per_parameter,
    layer_activation_bytes,
    layers_in_flight,
    stage_parameters,
    token_stats_bytes,
)
from megatron_zcpo.planning.planner import candidate_layouts, plan_memory, render_plan, suggest_layout

# Public config.json values (Hugging Face hub).
QWEN25_32B = ModelConfig(
    family="qwen2",
    hidden_size=5120,
    num_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    intermediate_size=27648,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN25_72B = ModelConfig(
    family="qwen2",
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=29568,
    vocab_size=152064,
    tie_word_embeddings=False,
)
LLAMA33_70B = ModelConfig(
    family="llama",
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    tie_word_embeddings=False,
)
TINY_TIED = ModelConfig(
    family="qwen2",
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=1000,
)

LONG_ZCPO = Workload(micro_batch_tokens=22528, max_sequence_length=22528)  # 16,384 + 4,096 + prompt


@pytest.mark.parametrize(
    "model, expected",
    [
        # The safetensors index total_size / 2 (bf16) of each public checkpoint.
        (QWEN25_32B, 32_763_876_352),
        (QWEN25_72B, 72_706_203_648),
        (LLAMA33_70B, 70_553_706_496),
    ],
)
def test_parameter_counts_match_the_public_checkpoints(model, expected):
    assert model.num_parameters == expected
    # 152064 and 128256 are multiples of 128, so at TP=1 Megatron adds no padding rows.
    assert stage_parameters(model, Layout(), "first") == expected


def test_stage_parameters_sum_over_ranks_to_the_model_plus_replicas_and_padding():
    model, tp = QWEN25_72B, 8
    layout = Layout(tensor_parallel=tp, pipeline_parallel=2)
    replicated = 2 * model.hidden_size * model.num_layers + model.hidden_size  # RMSNorm weights
    padding_rows = padded_vocab_size(model.vocab_size, tp) - model.vocab_size
    summed = tp * (stage_parameters(model, layout, "first") + stage_parameters(model, layout, "last"))
    assert summed == model.num_parameters + (tp - 1) * replicated + 2 * padding_rows * model.hidden_size


def test_tied_embedding_is_held_by_both_end_stages_under_pipeline_parallelism():
    embedding = TINY_TIED.vocab_size * TINY_TIED.hidden_size  # 1000 pads to 1024 rows at TP=1
    padded = padded_vocab_size(TINY_TIED.vocab_size, 1) * TINY_TIED.hidden_size
    whole = stage_parameters(TINY_TIED, Layout(), "first")
    assert whole == TINY_TIED.num_parameters + padded - embedding
    first = stage_parameters(TINY_TIED, Layout(pipeline_parallel=2), "first")
    last = stage_parameters(TINY_TIED, Layout(pipeline_parallel=2), "last")
    assert first + last == whole + padded  # the output layer's own copy of the tied weight


@pytest.mark.parametrize("shards", [1, 2, 8, 64])
def test_bytes_per_parameter_match_megatron_distributed_optimizer_table(shards):
    assert sum(bytes_per_parameter(False, shards).values()) == 18
    assert sum(bytes_per_parameter(True, shards).values()) == pytest.approx(6 + 12 / shards)


@pytest.mark.parametrize("distributed, expected", [(False, 18.0), (True, 6 + 12 / 8)])
def test_plan_static_memory_per_parameter_shards_over_data_and_context_parallel(distributed, expected):
    layout = Layout(tensor_parallel=8, context_parallel=2, data_parallel=4, distributed_optimizer=distributed)
    plan = plan_memory(QWEN25_32B, layout, LONG_ZCPO)
    static = sum(plan.components[key] for key in ("parameters", "gradients", "optimizer_states"))
    assert static / plan.parameters_on_gpu == pytest.approx(expected)
    assert plan.components["reference_model"] == 2 * plan.parameters_on_gpu


# GPT-3 175B as in Korthikanti et al. 2022: h=12288, a=96, s=2048, b=1, t=8.
S, B, H, A, T = 2048, 1, 12288, 96, 8
GPT_PAPER = dict(
    hidden_size=H,
    query_width=H,
    kv_width=2 * H,
    ffn_hidden_size=4 * H,
    num_heads=A,
    attention_span=S,
    gated_mlp=False,
    dropout=True,
    flash_attention=False,
)


@pytest.mark.parametrize(
    "tp, sp, recompute, paper",
    [
        (1, False, "none", S * B * H * (34 + 5 * A * S / H)),  # eq. (1)
        (T, False, "none", S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),  # eq. (2), TP only
        (T, True, "none", S * B * H / T * (34 + 5 * A * S / H)),  # eq. (4), TP + SP
        (T, True, "selective", S * B * H * 34 / T),  # eq. (6)
        (T, True, "full", 2 * S * B * H / T),  # full recompute, SP
        (T, False, "full", 2 * S * B * H),  # full recompute
    ],
)
def test_layer_activations_reproduce_korthikanti_for_their_architecture(tp, sp, recompute, paper):
    got = layer_activation_bytes(S * B, tensor_parallel=tp, sequence_parallel=sp, recompute=recompute, **GPT_PAPER)
    assert got == pytest.approx(paper, rel=1e-12)


def test_layer_activations_adapt_to_swiglu_gqa_and_flash_attention():
    base = dict(GPT_PAPER, dropout=False)
    # Without dropout the two 1-byte masks go: 34 -> 32 (selective, TP + SP).
    no_dropout = layer_activation_bytes(S, tensor_parallel=T, sequence_parallel=True, recompute="selective", **base)
    assert no_dropout == pytest.approx(S * H * 32 / T)
    # SwiGLU keeps FC1's second half too: + 2 bytes x ffn per token.
    swiglu = layer_activation_bytes(
        S, tensor_parallel=T, sequence_parallel=True, recompute="selective", **dict(base, gated_mlp=True)
    )
    assert swiglu - no_dropout == pytest.approx(S * 2 * 4 * H / T)
    # GQA with 8 of 96 KV heads stores smaller K and V: 2 bytes x (kv width difference).
    gqa_kv = 2 * 8 * (H // A)
    gqa = layer_activation_bytes(
        S, tensor_parallel=T, sequence_parallel=True, recompute="selective", **dict(base, kv_width=gqa_kv)
    )
    assert no_dropout - gqa == pytest.approx(S * 2 * (2 * H - gqa_kv) / T)
    # Flash attention never stores the probabilities: "none" costs only the fp32 log-sum-exp more.
    flash = layer_activation_bytes(
        S, tensor_parallel=T, sequence_parallel=True, recompute="none", **dict(base, flash_attention=True)
    )
    assert flash - no_dropout == pytest.approx(S * 4 * A / T)


def test_layers_in_flight_follow_megatron_schedules():
    layers, p, v = 80, 4, 5
    assert layers_in_flight(layers, 1, 0) == layers
    assert layers_in_flight(layers, p, 0) == layers  # 1F1B: p micro-batches x L/p
    assert layers_in_flight(layers, p, p - 1) == layers / p  # last stage: one micro-batch
    assert layers_in_flight(layers, p, 0, num_microbatches=2) == 2 * layers / p
    assert layers_in_flight(layers, p, 0, virtual_pipeline=v) == pytest.approx(
        layers * (1 + (p - 1) / (p * v))
    )  # Korthikanti Sec. 4.2.3


def test_plan_components_respond_to_reference_placement_and_kl_chunk():
    layout = Layout(tensor_parallel=8, data_parallel=4, recompute="full")
    resident = plan_memory(QWEN25_32B, layout, LONG_ZCPO)
    assert set(resident.components) == set(COMPONENTS)
    assert resident.fits and resident.phase == "train"
    assert resident.total_bytes == pytest.approx(resident.totals["first/train"])
    offloaded = plan_memory(QWEN25_32B, layout, dataclasses.replace(LONG_ZCPO, reference="offloaded"))
    assert offloaded.totals["first/train"] == pytest.approx(
        resident.totals["first/train"] - 2 * resident.parameters_on_gpu
    )
    assert offloaded.totals["first/experience"] == pytest.approx(resident.totals["first/experience"])
    # The torch backend's six fp32 tiles hold at most 2**25 elements: 1024 tokens x the whole shard
    # of 19,072 columns, or 4096 tokens x 8192 columns (ops/token_stats_kernels.py, _GPU_TILE).
    vocab_shard = padded_vocab_size(QWEN25_32B.vocab_size, 8) // 8
    torch_plans = [
        plan_memory(
            QWEN25_32B, layout, dataclasses.replace(LONG_ZCPO, token_stats_backend="torch", kl_chunk_tokens=chunk)
        )
        for chunk in (1024, 4096)
    ]
    assert torch_plans[1].components["logits_kl"] - torch_plans[0].components["logits_kl"] == pytest.approx(
        KL_FP32_BLOCKS * 4 * (4096 * 8192 - 1024 * vocab_shard)
    )
    assert resident.components["overhead"] == pytest.approx(0.1 * resident.capacity_bytes)


def test_triton_backend_counts_the_float16_caches_kept_for_the_backward():
    tokens, columns, hidden = 22528, 19008, 5120
    parts = token_stats_bytes(
        "triton",
        tokens=tokens,
        chunk_tokens=4096,
        vocab_columns=columns,
        hidden_size=hidden,
        with_reference=False,
        gradient=True,
    )
    assert parts == {
        "saved": tokens * columns * 2,
        "forward": 4096 * columns * 4,
        "backward": (tokens + hidden) * columns * 2,
    }  # bf16 logit and weight gradients
    with_reference = token_stats_bytes(
        "triton",
        tokens=tokens,
        chunk_tokens=4096,
        vocab_columns=columns,
        hidden_size=hidden,
        with_reference=True,
        gradient=False,
    )
    assert with_reference == {"saved": 0.0, "forward": 2 * 4096 * columns * 4, "backward": 0.0}  # experience pass
    torch_parts = token_stats_bytes(
        "torch",
        tokens=tokens,
        chunk_tokens=4096,
        vocab_columns=columns,
        hidden_size=hidden,
        with_reference=True,
        gradient=True,
    )
    assert torch_parts == {
        "saved": 0.0,
        "forward": KL_FP32_BLOCKS * 2**25 * 4,
        "backward": KL_FP32_BLOCKS * 2**25 * 4 + columns * hidden * 4,
    }

    # In the plan: an update that runs the reference (algorithm.kl_loss=full) keeps the log-ratio
    # cache and the reference's bf16 hidden states too; "auto" plans the Triton kernels.
    layout = Layout(tensor_parallel=8, data_parallel=4, recompute="full")
    plan = plan_memory(QWEN25_32B, layout, LONG_ZCPO)
    assert (plan.phase, plan.workload.token_stats_kernels) == ("train", "triton")
    kl_loss = plan_memory(QWEN25_32B, layout, dataclasses.replace(LONG_ZCPO, update_reference=True))
    vocab_shard = padded_vocab_size(QWEN25_32B.vocab_size, 8) // 8  # 19,072 with Megatron's padding
    assert kl_loss.components["logits_kl"] - plan.components["logits_kl"] == pytest.approx(
        tokens * vocab_shard * 2 + tokens * hidden * 2
    )
    assert "token statistics' triton backend (train.token_stats_backend=auto)" in render_plan(plan)


def test_most_loaded_stage_is_reported():
    # Long sequences without recompute: the first stage holds PP micro-batches of activations.
    heavy_activations = plan_memory(
        QWEN25_32B, Layout(tensor_parallel=8, pipeline_parallel=4, recompute="none"), LONG_ZCPO
    )
    assert (heavy_activations.stage, heavy_activations.phase) == ("first", "train")
    # Full recompute: the last stage's output layer and KL blocks dominate.
    light_activations = dataclasses.replace(heavy_activations.layout, recompute="full")
    assert plan_memory(QWEN25_32B, light_activations, LONG_ZCPO).stage == "last"


def test_unsharded_32b_on_one_gpu_does_not_fit():
    plan = plan_memory(QWEN25_32B, Layout(distributed_optimizer=False), LONG_ZCPO)
    assert not plan.fits
    assert plan.total_bytes > 18 * QWEN25_32B.num_parameters


def test_suggested_layout_is_the_smallest_fitting_model_parallel_and_prefers_tensor_parallel():
    suggestion = suggest_layout(QWEN25_32B, LONG_ZCPO, 32)
    assert suggestion is not None and suggestion.fits and suggestion.layout.num_gpus == 32
    fitting = [
        layout for layout in candidate_layouts(QWEN25_32B, 32) if plan_memory(QWEN25_32B, layout, LONG_ZCPO).fits
    ]
    smallest = min(layout.model_parallel_size for layout in fitting)
    assert suggestion.layout.model_parallel_size == smallest
    same_size = [layout for layout in fitting if layout.model_parallel_size == smallest]
    assert suggestion.layout.tensor_parallel == max(layout.tensor_parallel for layout in same_size)
    assert suggestion.layout.tensor_parallel <= Hardware().gpus_per_node


def test_small_model_needs_no_model_parallelism_and_huge_one_does_not_fit():
    tiny = suggest_layout(TINY_TIED, Workload(micro_batch_tokens=512, max_sequence_length=512), 8)
    assert tiny.layout.model_parallel_size == 1 and tiny.layout.data_parallel == 8
    assert tiny.layout.recompute == "none"
    assert suggest_layout(QWEN25_72B, LONG_ZCPO, 8) is None


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: plan_memory(QWEN25_32B, Layout(tensor_parallel=16), LONG_ZCPO), "layout.tensor_parallel=16"),
        (lambda: plan_memory(QWEN25_32B, Layout(pipeline_parallel=3), LONG_ZCPO), "layout.pipeline_parallel=3"),
        (lambda: plan_memory(QWEN25_32B, Layout(recompute="some"), LONG_ZCPO), "layout.recompute"),
        (lambda: plan_memory(QWEN25_32B, Layout(virtual_pipeline=2), LONG_ZCPO), "layout.virtual_pipeline"),
        (lambda: plan_memory(QWEN25_32B, Layout(), Workload(1024, 2048)), "workload.micro_batch_tokens"),
        (
            lambda: plan_memory(QWEN25_32B, Layout(), dataclasses.replace(LONG_ZCPO, reference="gpu")),
            "workload.reference",
        ),
        (
            lambda: plan_memory(QWEN25_32B, Layout(), dataclasses.replace(LONG_ZCPO, token_stats_backend="cuda")),
            "workload.token_stats_backend",
        ),
        (
            lambda: plan_memory(QWEN25_32B, Layout(), LONG_ZCPO, Hardware(headroom_fraction=1.5)),
            "hardware.headroom_fraction",
        ),
    ],
)
def test_bad_inputs_are_named(make, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_render_and_dict_forms():
    plan = plan_memory(QWEN25_32B, Layout(tensor_parallel=8, data_parallel=4, recompute="full"), LONG_ZCPO)
    text = render_plan(plan)
    for name in COMPONENTS:
        assert name in text
    assert "TP8 PP1 CP1 DP4" in text and "fits" in text and f"{plan.total_bytes / GIB:.2f}" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["total_gib"] == pytest.approx(sum(data["components_gib"].values()))
    assert data["fits"] is True and data["num_gpus"] == 32
