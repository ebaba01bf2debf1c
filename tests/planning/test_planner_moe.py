"""The planner and step model for mixture-of-experts models: active vs total parameters, experts per GPU, all-to-all."""

import dataclasses
import json

import pytest

from megatron_zcpo.cli.main import main
from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.planning.decode_rate import kv_bytes_per_token
from megatron_zcpo.planning.memory_model import STAGES, Layout, Workload
from megatron_zcpo.planning.planner import candidate_layouts, plan_memory
from megatron_zcpo.planning.step_time import (
    Cluster,
    StepLoad,
    forward_flops_per_token,
    predict_step_time,
    push_bytes_per_stage,
)
from tests.cli.test_examples import EXAMPLES

A3B, A22B = preset_model_config("Qwen3-30B-A3B"), preset_model_config("Qwen3-235B-A22B")
WORKLOAD = Workload(micro_batch_tokens=10240, max_sequence_length=10240)


def test_presets_have_the_published_total_and_active_sizes():
    assert 30.4e9 < A3B.num_parameters < 30.6e9 and 3.3e9 < A3B.num_active_parameters < 3.4e9
    assert 235.0e9 < A22B.num_parameters < 235.2e9 and 22.1e9 < A22B.num_active_parameters < 22.3e9


def test_deepseek_presets_have_the_published_sizes_and_a_latent_kv_cache():
    """DeepSeek-V3 671B (37B active, the multi-token-prediction layer not counted), Kimi-K2 1T (32B),
    Moonlight 16B (3B), as their model cards say. SGLang's MLA pool keeps kv_lora_rank +
    qk_rope_head_dim = 576 elements per token and layer, whole on every GPU of an attention group."""
    v3, k2 = preset_model_config("DeepSeek-V3"), preset_model_config("Kimi-K2")
    moonlight = preset_model_config("Moonlight-16B-A3B")
    assert 670.5e9 < v3.num_parameters < 671.5e9 and 37.0e9 < v3.num_active_parameters < 38.0e9
    assert 1.02e12 < k2.num_parameters < 1.04e12 and 32.0e9 < k2.num_active_parameters < 33.5e9
    assert 15.5e9 < moonlight.num_parameters < 16.5e9 and 2.5e9 < moonlight.num_active_parameters < 3.5e9
    assert kv_bytes_per_token(v3) == 61 * 576 * 2
    assert kv_bytes_per_token(v3, 32, dp_attention=8) == 4 * 61 * 576 * 2  # 8 groups of 4 GPUs


def test_expert_parallelism_divides_the_experts_and_their_optimizer_state():
    ep8 = plan_memory(A3B, Layout(tensor_parallel=1, data_parallel=16, expert_parallel=8), WORKLOAD)
    ep16 = plan_memory(A3B, Layout(tensor_parallel=1, data_parallel=16, expert_parallel=16), WORKLOAD)
    experts = A3B.num_layers * A3B.num_experts * A3B.expert_parameters()
    # EP16 holds half EP8's experts; each layout's expert optimizer state is sharded over its replicas
    assert ep8.parameters_on_gpu - ep16.parameters_on_gpu == pytest.approx(experts / 16, rel=1e-6)
    assert ep16.components["optimizer_states"] == pytest.approx(ep8.components["optimizer_states"], rel=0.05)
    with pytest.raises(ValueError, match="expert_parallel=3 must divide model.num_experts=128"):
        Layout(data_parallel=6, expert_parallel=3).validate(A3B)
    with pytest.raises(ValueError, match="has no experts"):
        Layout(data_parallel=2, expert_parallel=2).validate(preset_model_config("Qwen2.5-32B"))
    assert any(layout.expert_parallel > 1 for layout in candidate_layouts(A3B, 16))


def test_step_model_counts_active_parameters_all_to_all_and_expert_shares():
    load = StepLoad(generated_sequences=256, trained_sequences=256, prompt_tokens=1024, response_tokens=4096)
    cluster = Cluster(train_gpus=16, rollout_gpus=8, decode_tokens_per_s_per_gpu=2000.0)
    assert forward_flops_per_token(A3B, 1) < 0.15 * 2 * A3B.num_parameters  # the 8 of 128 experts a token uses
    ep1 = predict_step_time(A3B, load, cluster)
    ep8 = predict_step_time(A3B, load, cluster, expert_parallel=8)
    assert ep1.all_to_all_s == 0 and ep8.all_to_all_s > 0
    assert ep8.train_s == pytest.approx(ep1.train_s + ep8.all_to_all_s)
    assert push_bytes_per_stage(A3B, 1, 8) < push_bytes_per_stage(A3B, 1, 1) / 4  # each EP rank pushes its experts


@pytest.mark.parametrize(
    "example,gpus,rollout_gpus,preset",
    [("qwen3-30b-a3b-zcpo", 16, 8, "Qwen3-30B-A3B"), ("qwen3-235b-a22b-zcpo", 128, 64, "Qwen3-235B-A22B")],
)
def test_moe_examples_plan_with_nothing_downloaded(capsys, example, gpus, rollout_gpus, preset):
    config = str(EXAMPLES / example / "config.yaml")
    assert (
        main(["plan", config, "--gpus", str(gpus), "--rollout-gpus", str(rollout_gpus), "--preset", preset, "--json"])
        == 0
    )
    answer = json.loads(capsys.readouterr().out)
    assert answer["plan"]["fits"] and answer["plan"]["active_parameters"] < answer["plan"]["model_parameters"] / 9
    assert answer["step_time"]["all_to_all_s"] > 0


def test_qwen3_235b_at_pp8_takes_uneven_stages_and_the_busiest_stage_is_planned(capsys):
    """94 layers split only as PP 1, 2, 47 or 94 evenly; published runs use PP8 with 11 + 6 x 12 + 11.
    The planner evaluates the middle stages too: with 12 layers (and no embedding) one is the busiest."""
    from megatron_zcpo.megatron.model import padded_vocab_size
    from megatron_zcpo.planning.memory_model import layer_parameters, stage_expert_parameters, stage_parameters

    uneven = Layout(
        tensor_parallel=4,
        pipeline_parallel=8,
        data_parallel=4,
        expert_parallel=16,
        expert_tensor_parallel=1,
        recompute="full",  # as the example: activations are small, the stage's weights decide
    )
    with pytest.raises(
        ValueError, match="layout.pipeline_parallel=8 does not divide num_layers=94: e.g. layout.first_stage_layers=11"
    ):
        uneven.validate(A22B)
    uneven = dataclasses.replace(uneven, first_stage_layers=11, last_stage_layers=11)
    plan = plan_memory(A22B, uneven, WORKLOAD)
    assert plan.stage == "middle" and set(plan.totals) == {f"{s}/{p}" for s in STAGES for p in ("train", "experience")}
    per_layer = layer_parameters(A22B, 4) + stage_expert_parameters(A22B, uneven, "middle") / 12
    assert plan.parameters_on_gpu == pytest.approx(12 * per_layer, rel=1e-6)
    assert stage_parameters(A22B, uneven, "middle") - stage_parameters(A22B, uneven, "first") == pytest.approx(
        per_layer - padded_vocab_size(A22B.vocab_size, 4) * A22B.hidden_size / 4, rel=1e-9
    )
    example = str(EXAMPLES / "qwen3-235b-a22b-zcpo" / "config.yaml")
    keys = ["parallel.pipeline=8", "parallel.expert=16", "parallel.first_stage_layers=11"]
    args = ["plan", example, "--gpus", "128", "--rollout-gpus", "64", "--preset", "Qwen3-235B-A22B", "--json"]
    assert main(args + keys + ["parallel.last_stage_layers=11"]) == 0
    planned = json.loads(capsys.readouterr().out)["plan"]
    assert planned["fits"] and planned["most_loaded"]["stage"] == "middle"
    with pytest.raises(SystemExit, match="parallel.first_stage_layers=11 leaves 83 layers to 7 other stage"):
        main(args + keys)
