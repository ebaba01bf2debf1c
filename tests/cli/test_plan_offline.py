"""`zcpo plan` before anything is downloaded: presets, a lone config.json, and the step-time model."""

import json

import pytest

from megatron_zcpo.cli.main import main
from megatron_zcpo.cli.plan import load_plan_config, model_config_of
from megatron_zcpo.convert.presets import HF_CONFIGS, preset_model_config
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.megatron.step_time import Cluster, StepLoad, predict_step_time, push_bytes_per_stage
from tests.cli.test_examples import EXAMPLES, LLAMA33_70B, QUOTED, QWEN25_32B, QWEN25_72B

QWEN_EXAMPLE = str(EXAMPLES / "qwen2.5-32b-zcpo" / "config.yaml")
LLAMA_EXAMPLE = str(EXAMPLES / "llama-3.3-70b-zcpo" / "config.yaml")


def test_presets_are_the_public_architectures():
    assert preset_model_config("Qwen2.5-32B") == QWEN25_32B
    assert preset_model_config("llama-3.3-70b-instruct") == LLAMA33_70B
    assert preset_model_config("Qwen2.5-72B") == QWEN25_72B
    assert 72e9 < QWEN25_72B.num_parameters < 73e9
    with pytest.raises(ValueError, match="Qwen2.5-32B"):
        preset_model_config("Qwen2.5-7B")


def test_the_shipped_example_plans_with_nothing_downloaded(capsys):
    """The config as shipped: model.path and data files absent; the same numbers as the quoted plan."""
    with pytest.raises(SystemExit, match="model.path=.*--model-config.*--preset"):
        main(["plan", QWEN_EXAMPLE, "--gpus", "32"])
    assert main(["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert round(answer["plan"]["total_gib"], 2) == QUOTED["qwen2.5-32b-zcpo"][1]
    assert answer["rollout_mode"] == "sequential"
    timing = answer["step_time"]
    assert timing["sequential_s"] == pytest.approx(timing["rollout_s"] + timing["train_s"] + timing["push_per_stage_s"])


def test_a_lone_config_json_is_enough(tmp_path, capsys):
    model_dir = tmp_path / "Llama-3.3-70B-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIGS["Llama-3.3-70B"]))
    assert main(["plan", LLAMA_EXAMPLE, "--gpus", "64", "--model-config", str(model_dir / "config.json")]) == 0
    text = capsys.readouterr().out
    assert f"{QUOTED['llama-3.3-70b-zcpo'][1]:.2f}" in text and "rollout mode: sequential, on-policy" in text
    # model.path pointing at a directory that holds only config.json works as well
    config = load_plan_config(LLAMA_EXAMPLE, [f"model.path={model_dir}", "rollout.overlap=true"])
    assert model_config_of(config) == LLAMA33_70B and config.rollout.overlap
    assert main(["plan", LLAMA_EXAMPLE, "--gpus", "64", f"model.path={model_dir}", "rollout.overlap=true"]) == 0
    assert "rollout mode: overlapped" in capsys.readouterr().out


def test_planned_sections_are_still_validated():
    with pytest.raises(Exception, match="rollout.max_staleness"):
        load_plan_config(QWEN_EXAMPLE, ["rollout.overlap=true", "rollout.max_staleness=0"])


def test_step_time_terms_by_hand():
    model = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    load = StepLoad(generated_sequences=200, trained_sequences=100, prompt_tokens=100, response_tokens=300)
    cluster = Cluster(train_gpus=4, rollout_gpus=2, decode_tokens_per_s_per_gpu=1000.0, mfu=0.5,
                      peak_flops=1e9, link_bytes_per_s=1e6)
    time = predict_step_time(model, load, cluster, pipeline_parallel=2, recompute="none")
    assert time.rollout_s == pytest.approx(200 * 300 / 2000)
    dense = model.num_parameters - 1000 * 64
    per_token = 2 * dense + 4 * 2 * 4 * 16 * 400 / 2
    assert time.train_s == pytest.approx(100 * 400 * per_token * 5 / (4 * 1e9 * 0.5))
    assert time.push_funnel_s == pytest.approx(2 * model.num_parameters / 1e6)
    # PP2: the larger stage holds half the layers (+ final norm) and one vocabulary matrix
    assert push_bytes_per_stage(model, 2) == pytest.approx((2 * model.num_parameters - 4 * 64000) / 2 + 2 * 64000)
    assert time.overlapped_s == pytest.approx(max(time.rollout_s, time.train_s) + time.push_per_stage_s)
    assert time.overlapped_s < time.sequential_s and time.idle_share_overlapped < time.idle_share_sequential


@pytest.mark.parametrize("example,gpus,preset,decode", [("qwen2.5-32b-zcpo", 32, "Qwen2.5-32B", 1000),
                                                        ("llama-3.3-70b-zcpo", 64, "Llama-3.3-70B", 500),
                                                        ("qwen2.5-72b-zcpo", 64, "Qwen2.5-72B", 500)])
def test_the_examples_quote_the_predicted_step_time(example, gpus, preset, decode, capsys):
    path = str(EXAMPLES / example / "config.yaml")
    main(["plan", path, "--gpus", str(gpus), "--preset", preset, "--decode-tokens-per-s", str(decode), "--json"])
    timing = json.loads(capsys.readouterr().out)["step_time"]
    comments = (EXAMPLES / example / "config.yaml").read_text()
    assert f"= {timing['sequential_s']:,.0f} s" in comments
    assert f"rollout.overlap=true (one step off-policy) {timing['overlapped_s']:,.0f} s" in comments
