"""`zcpo plan` before anything is downloaded: presets, a lone config.json, and the step-time model."""

import json

import pytest

from megatron_zcpo.cli.main import main
from megatron_zcpo.cli.plan import load_plan_config, model_config_of
from megatron_zcpo.convert.presets import HF_CONFIGS, preset_model_config
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.decode_rate import decode_tokens_per_s_per_gpu
from megatron_zcpo.planning.step_time import Cluster, StepLoad, predict_step_time, push_bytes_per_stage
from megatron_zcpo.planning.transitions import PUSH_BYTES_S, PUSH_FIXED_S
from tests.cli.test_examples import EXAMPLES, LLAMA33_70B, QUOTED, QWEN3_4B_THINKING, QWEN25_32B, QWEN25_72B

QWEN_EXAMPLE = str(EXAMPLES / "qwen2.5-32b-zcpo" / "config.yaml")
LLAMA_EXAMPLE = str(EXAMPLES / "llama-3.3-70b-zcpo" / "config.yaml")


def test_presets_are_the_public_architectures():
    assert preset_model_config("Qwen2.5-32B") == QWEN25_32B
    assert preset_model_config("Qwen3-4B-Thinking-2507") == QWEN3_4B_THINKING
    assert preset_model_config("llama-3.3-70b-instruct") == LLAMA33_70B
    assert preset_model_config("Qwen2.5-72B") == QWEN25_72B
    assert 72e9 < QWEN25_72B.num_parameters < 73e9
    with pytest.raises(ValueError, match="Qwen2.5-32B"):
        preset_model_config("Qwen2.5-3B")
    # the calibration anchors (benchmarks/RESULTS.md): the published sizes of their model cards
    sizes = {"Qwen3-32B": 32.8e9, "Qwen3-8B": 8.2e9, "Llama-3.1-8B": 8.03e9, "Llama-3.1-70B": 70.55e9}
    for name, size in sizes.items():
        assert preset_model_config(name).num_parameters == pytest.approx(size, rel=0.002), name
    assert preset_model_config("Llama-3.1-70B-Instruct") == LLAMA33_70B


def test_the_shipped_example_plans_with_nothing_downloaded(capsys):
    """The config as shipped: model.path and data files absent, model.preset names the architecture;
    the same numbers as the quoted plan. Without model.preset (nor a flag) the keys to set are named."""
    with pytest.raises(SystemExit, match="model.path=.*model.preset.*--model-config.*--preset"):
        main(["plan", QWEN_EXAMPLE, "--gpus", "32", "model.preset=null"])
    assert main(["plan", QWEN_EXAMPLE, "--gpus", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == _plan_json(capsys)  # (which names the preset)
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
    config = load_plan_config(LLAMA_EXAMPLE, [f"model.path={model_dir}", "rollout.mode=overlap"])
    assert model_config_of(config) == LLAMA33_70B and config.rollout.mode == "overlap"
    assert main(["plan", LLAMA_EXAMPLE, "--gpus", "64", f"model.path={model_dir}", "rollout.mode=overlap"]) == 0
    assert "rollout mode: overlapped" in capsys.readouterr().out


def test_the_asynchronous_step_amortises_the_longest_response(capsys):
    """A long tail (the longest response 4x the mean) on a small batch, where it outlasts the bulk: the
    sequential and overlapped steps wait for it, the asynchronous one spreads it over the k + 1 steps a
    response may span; the plan prints all three."""
    overrides = [
        "rollout.mode=async",
        "rollout.max_staleness=2",
        "rollout.prompts_per_step=32",
        "--response-fraction",
        "0.25",
    ]
    answer = _plan_json(capsys, *overrides)
    timing = answer["step_time"]
    assert answer["rollout_mode"] == "asynchronous" and timing["predicted_s"] == timing["asynchronous_s"]
    assert timing["tail_s"] > timing["bulk_s"]  # the tail holds the synchronous rollout
    assert timing["asynchronous_s"] < timing["overlapped_s"] < timing["sequential_s"]
    assert main(["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B", *overrides]) == 0
    text = capsys.readouterr().out
    assert "rollout mode: asynchronous (rollout.mode=async, max_staleness 2)" in text
    gains = f"{timing['sequential_s'] / timing['overlapped_s']:.2f}x and {timing['sequential_s'] / timing['asynchronous_s']:.2f}x"
    assert gains + " as fast as sequential" in text


def test_planned_sections_are_still_validated():
    with pytest.raises(Exception, match="rollout.max_staleness"):
        load_plan_config(QWEN_EXAMPLE, ["rollout.mode=overlap", "rollout.max_staleness=0"])


def test_step_time_terms_by_hand():
    model = ModelConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    load = StepLoad(generated_sequences=200, trained_sequences=100, prompt_tokens=100, response_tokens=300)
    cluster = Cluster(
        train_gpus=4, rollout_gpus=2, decode_tokens_per_s_per_gpu=1000.0, mfu=0.5, peak_flops=1e9, rollout_tp=1
    )
    time = predict_step_time(model, load, cluster, pipeline_parallel=2, recompute="none")
    assert time.rollout_s == pytest.approx(200 * 300 / 2000)
    dense = model.num_parameters - 1000 * 64
    per_token = 2 * dense + 4 * 2 * 4 * 16 * 400 / 2
    assert time.train_s == pytest.approx(100 * 400 * per_token * 5 / (4 * 1e9 * 0.5))
    assert time.push_funnel_s == pytest.approx(PUSH_FIXED_S + 2 * model.num_parameters / PUSH_BYTES_S)
    # PP2: the larger stage holds half the layers (+ final norm) and one vocabulary matrix
    assert push_bytes_per_stage(model, 2) == pytest.approx((2 * model.num_parameters - 4 * 64000) / 2 + 2 * 64000)
    assert time.overlapped_s == pytest.approx(max(time.rollout_s, time.train_s) + time.push_per_stage_s)
    assert time.overlapped_s < time.sequential_s and time.idle_share_overlapped < time.idle_share_sequential
    assert time.predicted_s == time.sequential_s and time.mode == "sequential"
    # asynchronous at staleness 2: the bulk, the training or a third of the longest response, then the push
    tail_bound = predict_step_time(model, load, cluster, pipeline_parallel=2, rollout_mode="async", max_staleness=2)
    assert tail_bound.predicted_s == tail_bound.asynchronous_s and tail_bound.mode == "asynchronous"
    assert tail_bound.asynchronous_s == pytest.approx(
        max(time.bulk_s, time.train_s, time.tail_s / 3) + time.push_per_stage_s
    )
    assert time.asynchronous_s == pytest.approx(max(time.bulk_s, time.train_s, time.tail_s / 2) + time.push_per_stage_s)
    # colocated: generation on the 4 training GPUs, offload/onload and the IPC push instead of NCCL
    colocated = predict_step_time(
        model, load, Cluster(**{**vars(cluster), "placement": "colocated"}), offloaded_bytes_per_gpu=5e10
    )
    assert colocated.rollout_s == pytest.approx(200 * 300 / 4000) and colocated.offload_s == pytest.approx(2.0)
    assert colocated.predicted_s == pytest.approx(
        colocated.rollout_s + colocated.train_s + colocated.offload_s + colocated.ipc_push_s
    )
    assert colocated.tokens_per_s_per_gpu == pytest.approx(100 * 400 / (colocated.predicted_s * 4))


@pytest.mark.parametrize(
    "example,gpus,preset",
    [
        ("qwen2.5-32b-zcpo", 32, "Qwen2.5-32B"),
        ("llama-3.3-70b-zcpo", 64, "Llama-3.3-70B"),
        ("qwen2.5-72b-zcpo", 64, "Qwen2.5-72B"),
    ],
)
def test_the_examples_quote_the_predicted_step_time(example, gpus, preset, capsys):
    path = str(EXAMPLES / example / "config.yaml")
    main(["plan", path, "--gpus", str(gpus), "--preset", preset, "--json"])
    answer = json.loads(capsys.readouterr().out)
    timing = answer["step_time"]
    comments = (EXAMPLES / example / "config.yaml").read_text()
    assert f"modelled {answer['decode_tokens_per_s_per_gpu']:,.0f} generated tokens/s per rollout GPU" in comments
    assert f"= {timing['sequential_s']:,.0f} s" in comments
    assert f"rollout.mode=overlap (one step off-policy) {timing['overlapped_s']:,.0f} s" in comments


def _plan_json(capsys, *extra):
    assert main(["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_decode_rate_is_modelled_unless_given(capsys):
    """Default: the calibrated roofline at the config's mean lengths (1,024 prompt, 10,240 response)
    on TP4 servers (32B <= 40B parameters); --rollout-tp and rollout.sglang.launch change the
    servers; --decode-tokens-per-s overrides the model."""
    modelled = _plan_json(capsys)
    expected = decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 4, mem_fraction=0.85)
    assert modelled["decode_tokens_per_s_per_gpu"] == pytest.approx(expected)
    assert modelled["decode_source"].startswith("modelled for TP4 servers")
    assert modelled["step_time"]["rollout_s"] == pytest.approx(12288 * 10240 / (expected * 32))
    tp8 = _plan_json(capsys, "--rollout-tp", "8")
    assert tp8["decode_tokens_per_s_per_gpu"] == pytest.approx(
        decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 8, mem_fraction=0.85)
    )
    launched = _plan_json(
        capsys,
        "rollout.sglang.launch.model_path=hf",
        "rollout.sglang.launch.tp_size=8",
        "rollout.sglang.launch.mem_fraction_static=0.9",
    )
    assert launched["decode_tokens_per_s_per_gpu"] == pytest.approx(
        decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 8, mem_fraction=0.9)
    )
    assert launched["decode_source"].startswith("modelled for TP8 servers (mem_fraction_static 0.9)")
    given = _plan_json(capsys, "--decode-tokens-per-s", "1000")
    assert given["decode_tokens_per_s_per_gpu"] == 1000 and given["decode_source"].startswith("given")
    assert given["step_time"]["rollout_s"] == pytest.approx(12288 * 10240 / (1000 * 32))
    assert main(["plan", LLAMA_EXAMPLE, "--gpus", "64", "--preset", "Llama-3.3-70B"]) == 0
    assert "generated tokens/s per rollout GPU, modelled for TP8 servers" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no KV cache left"):
        main(["plan", LLAMA_EXAMPLE, "--gpus", "64", "--preset", "Llama-3.3-70B", "--rollout-tp", "1"])


def test_the_modelled_servers_decode_only_the_requests_in_flight(capsys):
    """With rollout.sglang.client.max_concurrency=32 over the 8 TP4 servers each decodes 4 sequences,
    not the 76 its KV cache holds: the modelled rate is that of a batch of 4 (and the slower rollout
    outlasts the shipped rollout_timeout_s: the plan fails)."""
    args = ["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B", "--json"]
    assert main([*args, "rollout.sglang.client.max_concurrency=32"]) == 1
    bounded = json.loads(capsys.readouterr().out)
    expected = decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 4, mem_fraction=0.85, max_batch=4)
    assert bounded["decode_tokens_per_s_per_gpu"] == pytest.approx(expected)
    assert expected < decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 4, mem_fraction=0.85) / 5


def test_plan_checks_every_timeout_against_the_predicted_durations(capsys):
    """The shipped 32B example passes; with 6,000 s, dynamic sampling's first round (12,288 samples,
    ~6,920 s) outlasts rollout_timeout_s: the plan says which key to raise and fails."""
    assert main(["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B"]) == 0
    text = capsys.readouterr().out
    assert "rollout.sglang.client.rollout_timeout_s" in text and "parallel.collective_timeout_s" in text
    assert "RAISE" not in text
    assert (
        main(
            [
                "plan",
                QWEN_EXAMPLE,
                "--gpus",
                "32",
                "--preset",
                "Qwen2.5-32B",
                "rollout.sglang.client.rollout_timeout_s=6000",
                "--json",
            ]
        )
        == 1
    )
    failed = [check for check in json.loads(capsys.readouterr().out)["timeouts"] if not check["ok"]]
    assert {check["key"] for check in failed} == {"rollout.sglang.client.rollout_timeout_s"}
    assert any("first round" in check["bounds"] and 6800 < check["predicted_s"] < 7000 for check in failed)


def test_without_the_cluster_size_short_timeouts_are_reported_not_fatal(capsys):
    """Planned on the fewest GPUs that fit (a guess at the cluster), the 32B example's rollout is
    slower than on its 32 GPUs: a short timeout is shown, and the plan still succeeds."""
    assert main(["plan", QWEN_EXAMPLE, "--preset", "Qwen2.5-32B", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["cluster_given"] is False and answer["timeouts_checked_for_rollout_gpus"] < 32
    assert main(["plan", QWEN_EXAMPLE, "--preset", "Qwen2.5-32B"]) == 0
    assert "a guess: give --gpus N" in capsys.readouterr().out
    assert (
        main(["plan", QWEN_EXAMPLE, "--preset", "Qwen2.5-32B", "--gpus", "32", "--rollout-gpus", "8"]) == 1
    )  # a given cluster: fatal
