"""examples/: every config validates as train.sbatch runs it, its layout fits 80 GB H100s, the scripts parse."""

import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from megatron_zcpo.checkpoint.io import write_model_config
from megatron_zcpo.cli.plan import model_config_of, plan_inputs
from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.planner import GIB, plan_memory, suggest_layout
from megatron_zcpo.recipe.config import load_run_config
from megatron_zcpo.rollout.sglang.client import SGLangEngineConfig
from megatron_zcpo.utils.config_loader import load_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# config.json of the public checkpoints (Hugging Face hub).
QWEN25_32B = ModelConfig(
    family="qwen2",
    hidden_size=5120,
    num_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    intermediate_size=27648,
    vocab_size=152064,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    qkv_bias=True,
)
LLAMA33_70B = ModelConfig(
    family="llama",
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    qkv_bias=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
QWEN25_72B = ModelConfig(
    family="qwen2",
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=29568,
    vocab_size=152064,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    qkv_bias=True,
)
QWEN3_4B_THINKING = ModelConfig(
    family="qwen3",
    hidden_size=2560,
    num_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    vocab_size=151936,
    max_position_embeddings=262144,
    rope_theta=5000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
MODELS = {
    "qwen2.5-32b-zcpo": QWEN25_32B,
    "qwen2.5-32b-colocated-zcpo": QWEN25_32B,
    "qwen2.5-7b-colocated-zcpo": preset_model_config("Qwen2.5-7B"),
    "qwen2.5-32b-code-tool-zcpo": QWEN25_32B,  # the Instruct model's config.json has the same architecture
    "llama-3.3-70b-zcpo": LLAMA33_70B,
    "qwen2.5-72b-zcpo": QWEN25_72B,
    "llama-3.3-70b-lora-zcpo": LLAMA33_70B,
    "qwen2.5-72b-lora-zcpo": QWEN25_72B,
    "qwen3-4b-long-context-zcpo": QWEN3_4B_THINKING,
    # mixture of experts: the hub's config.json fields (megatron_zcpo/convert/presets.py)
    "qwen3-30b-a3b-zcpo": preset_model_config("Qwen3-30B-A3B"),
    "qwen3-235b-a22b-zcpo": preset_model_config("Qwen3-235B-A22B"),
    "deepseek-v3-671b-zcpo": preset_model_config("DeepSeek-V3"),
    "moonlight-16b-a3b-zcpo": preset_model_config("Moonlight-16B-A3B"),
}
# (training GPUs, GiB per GPU) quoted in the example's config.yaml and examples/README.md.
QUOTED = {
    "qwen2.5-32b-zcpo": (32, 55.35),
    "qwen2.5-32b-colocated-zcpo": (16, 63.00),
    "qwen2.5-7b-colocated-zcpo": (8, 50.19),
    "qwen2.5-32b-code-tool-zcpo": (32, 57.25),
    "llama-3.3-70b-zcpo": (64, 59.03),
    "qwen2.5-72b-zcpo": (64, 60.73),
    "llama-3.3-70b-lora-zcpo": (8, 56.65),
    "qwen2.5-72b-lora-zcpo": (8, 58.31),
    "qwen3-4b-long-context-zcpo": (32, 61.39),
    "qwen3-30b-a3b-zcpo": (16, 65.93),
    "qwen3-235b-a22b-zcpo": (128, 75.57),
    "deepseek-v3-671b-zcpo": (512, 68.40),
    "moonlight-16b-a3b-zcpo": (8, 64.78),
}
# The configured layout is the planner's (memory-only) suggestion, except where the config says why not.
SUGGESTED_INSTEAD = {
    "qwen3-4b-long-context-zcpo": ("TP2 PP1 CP2 DP8 distopt recompute=full", 77.93),
    # colocated: full recompute keeps room for the servers' CUDA contexts and NCCL buffers
    "qwen2.5-7b-colocated-zcpo": ("TP2 PP1 CP1 DP4 SP distopt recompute=none", 65.53),
}


def rollout_nodes(settings: dict) -> int:
    """The nodes an example's SGLang servers run on: all of them colocated, else those past TRAIN_NODES."""
    if settings.get("PLACEMENT") == "colocated":
        return int(settings["nodes"])
    return int(settings["nodes"]) - int(settings["TRAIN_NODES"])


def test_every_cluster_example_is_covered():
    assert sorted(p.parent.name for p in EXAMPLES.glob("*/config.yaml")) == sorted(MODELS)


def sbatch_settings(example: str) -> dict:
    """The #SBATCH header and the layout variables (NAME=${NAME:-value}) of an example's train.sbatch."""
    text = (EXAMPLES / example / "train.sbatch").read_text()
    settings = {key: value for key, value in re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M)}
    settings.update(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", text, re.M))
    return settings


def run_config(example: str, tmp_path: Path, extra=()):
    """The example's config with the overrides train.sbatch passes (fake checkpoint and addresses).

    The checkpoint directory holds only model_config.json of the real architecture: what
    validation and the planner read.
    """
    checkpoint = tmp_path / "megatron_checkpoint"
    write_model_config(checkpoint, MODELS[example])
    overrides = [
        f"model.path={checkpoint}",
        'data.train_files=["/data/dapo-math-17k.parquet"]',
        'eval.data.train_files=["/data/aime-2024.jsonl","/data/aime-2025.jsonl"]',
        'rollout.sglang.server_urls=["http://rollout-0:30000","http://rollout-0:30010"]',
        "rollout.sglang.router_url=http://rollout-0:29000",
        f"logging.run_dir={tmp_path / 'run'}",
        *extra,
    ]
    return load_run_config(str(EXAMPLES / example / "config.yaml"), overrides)


@pytest.mark.parametrize("example", sorted(MODELS))
def test_config_validates_with_the_sbatch_overrides(example, tmp_path):
    config = run_config(example, tmp_path)
    assert model_config_of(config) == MODELS[example]
    assert config.rollout.engine == "sglang" and config.rollout.sglang.launch is None
    # rollout.sglang.client is only read when the engine starts: check its keys now.
    SGLangEngineConfig(
        server_urls=config.rollout.sglang.server_urls,
        router_url=config.rollout.sglang.router_url,
        **config.rollout.sglang.client,
    ).validate()
    settings = sbatch_settings(example)
    assert not {"TRAIN_TP", "TRAIN_PP", "TRAIN_CP", "TRAIN_EP"} & set(settings)  # the layout is the config's alone
    turns = config.tools.max_turns if config.tools.enabled else 1  # with tools: the policy's tokens over all turns
    assert config.reward.max_response_length == config.rollout.max_new_tokens * turns
    assert settings["CONFIG"] == f"examples/{example}/config.yaml"


@pytest.mark.parametrize("example", sorted(MODELS))
def test_the_servers_train_sbatch_starts_agree_with_the_config_and_the_pinned_sglang(example, tmp_path, monkeypatch):
    """sglang_node.py --run-config (the resolved config) starts servers that pass the client's start-up
    check (mock servers with the same flags), and every timeout outlasts the predicted duration it bounds."""
    from megatron_zcpo.recipe.config import dump_run_config
    from megatron_zcpo.recipe.timeouts import RolloutServers, check_timeouts
    from megatron_zcpo.rollout.sglang.client import SGLangEngine
    from megatron_zcpo.rollout.sglang.server import ServerSpec, router_command, server_command
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from tests.rollout.sglang.test_sglang_client import ScriptedEngine

    config = run_config(example, tmp_path)
    resolved = tmp_path / "config.resolved.yaml"
    resolved.write_text(dump_run_config(config))
    settings, sglang_node = sbatch_settings(example), load_sglang_node()
    monkeypatch.setenv("ZCPO_SGLANG_API_KEY", "per-job-key")
    launch = sglang_node.server_config(
        sglang_node.parse_args(
            [
                "--model-path",
                "/m",
                "--nodes",
                "gpu05,gpu06",
                "--tp-size",
                settings["ROLLOUT_TP"],
                "--run-config",
                str(resolved),
            ]
        )
    )
    client = SGLangEngineConfig(server_urls=["http://x:1"], router_url="http://r:2", **config.rollout.sglang.client)
    command = server_command(ServerSpec("gpu05", 30000, ("0",)), launch)
    flags = dict(zip(command[3::2], command[4::2]))
    assert (flags["--host"], flags["--api-key"]) == ("gpu05", "per-job-key")
    router = router_command(["http://gpu05:30000"], launch, "gpu05")
    assert int(router[router.index("--request-timeout-secs") + 1]) == client.router_timeout_s > client.request_timeout_s
    assert ("--enable-deterministic-inference" in command) == client.sampling_seeds
    assert ("--enable-memory-saver" in command) == (config.rollout.placement == "colocated")
    assert config.rollout.placement == settings.get("PLACEMENT", "disaggregated")
    prompt, new_tokens = config.data.max_prompt_length, config.rollout.max_new_tokens
    with (
        MockSGLangServer(
            ScriptedEngine(),
            context_length=int(flags["--context-length"]),
            api_key="per-job-key",
            deterministic_inference="--enable-deterministic-inference" in command,
        ) as server,
        SGLangEngine(SGLangEngineConfig(server_urls=[server.url], **config.rollout.sglang.client)) as engine,
    ):
        engine.check_servers(prompt, new_tokens)
    # every node must start its servers with the job's one key: none in the environment, no servers
    monkeypatch.delenv("ZCPO_SGLANG_API_KEY")
    assert sglang_node.main(["--model-path", "/m", "--nodes", "gpu05", "--tp-size", "8"]) == 2
    rollout_gpus = rollout_nodes(settings) * int(settings["gpus-per-node"])
    check_timeouts(
        config,
        MODELS[example],
        RolloutServers(count=rollout_gpus // int(settings["ROLLOUT_TP"]), tp_size=int(settings["ROLLOUT_TP"])),
    )


@pytest.mark.parametrize("example", sorted(MODELS))
def test_layout_fits_80gb_h100_and_is_the_planners_suggestion(example, tmp_path):
    config = run_config(example, tmp_path)
    settings = sbatch_settings(example)
    gpus_per_node = int(settings["gpus-per-node"])
    train_gpus = int(settings["TRAIN_NODES"]) * gpus_per_node
    layout, workload = plan_inputs(config, train_gpus)
    plan = plan_memory(model_config_of(config), layout, workload)
    assert plan.fits, plan.to_dict()
    assert (train_gpus, round(plan.total_bytes / GIB, 2)) == QUOTED[example]
    suggested = suggest_layout(model_config_of(config), workload, train_gpus, base=layout)
    if example in SUGGESTED_INSTEAD:
        assert (suggested.layout.describe(), round(suggested.total_bytes / GIB, 2)) == SUGGESTED_INSTEAD[example]
    else:
        assert suggested.layout == layout
    # Rollout nodes: the rest of the allocation, whole SGLang servers per node (or whole nodes per server).
    rollout_gpus, server_gpus = rollout_nodes(settings) * gpus_per_node, int(settings["ROLLOUT_TP"])
    assert rollout_nodes(settings) >= 1 and rollout_gpus % server_gpus == 0
    assert gpus_per_node % server_gpus == 0 or server_gpus % gpus_per_node == 0


@pytest.mark.parametrize("example,quoted", [("qwen2.5-72b-lora-zcpo", 59.17), ("llama-3.3-70b-lora-zcpo", 57.50)])
def test_lora_examples_train_on_four_gpus_where_the_full_weights_need_sixty_four(example, quoted, tmp_path):
    """The fewest GPUs their config.yaml states: TP4 DP1 fits (TP2 would hold 72 GB of frozen weights alone)."""
    config = run_config(example, tmp_path)
    model = model_config_of(config)
    layout, workload = plan_inputs(config, 4)
    plan = plan_memory(model, layout, workload)
    assert plan.fits and round(plan.total_bytes / GIB, 2) == quoted
    assert workload.reference == "adapters_off" and plan.components["reference_model"] == 0
    two = plan_memory(model, dataclasses.replace(layout, tensor_parallel=2, data_parallel=1), workload)
    assert not two.fits


def test_70b_eight_node_variant_fits_with_the_reference_offloaded(tmp_path):
    config = run_config("llama-3.3-70b-zcpo", tmp_path, ["train.reference_offload=true"])
    layout, workload = plan_inputs(config, 32)
    plan = plan_memory(model_config_of(config), layout, workload)
    assert layout.data_parallel == 2 and workload.reference == "offloaded"
    assert plan.fits and round(plan.total_bytes / GIB, 2) == 67.38
    resident = plan_memory(model_config_of(config), layout, dataclasses.replace(workload, reference="resident"))
    assert resident.total_bytes > plan.total_bytes


def test_qwen_example_has_the_papers_hyper_parameters(tmp_path):
    config = run_config("qwen2.5-32b-zcpo", tmp_path)
    rollout, train, algorithm, reward = config.rollout, config.train, config.algorithm, config.reward
    assert (rollout.samples_per_prompt, rollout.prompts_per_step, train.mini_batches) == (16, 512, 16)
    assert (algorithm.name, algorithm.beta, algorithm.clip_low, algorithm.clip_high, algorithm.agg) == (
        "zcpo",
        4.0,
        0.2,
        0.28,
        "token-mean",
    )
    assert algorithm.resolved().kl_loss == "none" and algorithm.drift == "conditional_kl"
    assert rollout.max_new_tokens == reward.max_response_length == 16384 + 4096 and reward.overlong_buffer == 4096
    assert reward.overlong_penalty and reward.overlong_filter and rollout.dynamic_sampling.drop_tied_groups
    assert (train.optimizer.lr, train.optimizer.warmup_steps, train.optimizer.schedule) == (1e-6, 20, "constant")
    assert train.bf16 and config.parallel.distributed_optimizer and train.recompute == "full"
    assert (config.eval.k, config.eval.temperature, config.eval.top_p) == (32, 1.0, 0.7)


def test_long_context_example_has_appendix_e_and_its_recipes_values(tmp_path):
    config = run_config("qwen3-4b-long-context-zcpo", tmp_path)
    model = model_config_of(config)
    assert (model.family, model.qk_layernorm, model.qkv_bias, model.head_dim, model.hidden_size) == (
        "qwen3",
        True,
        False,
        128,
        2560,
    )
    algorithm, train, rollout, sampling = (
        config.algorithm,
        config.train,
        config.rollout,
        config.train.importance_sampling,
    )
    assert (algorithm.name, algorithm.beta, algorithm.gate, algorithm.clip_c) == ("zcpo", 4.0, True, 3.0)
    assert (algorithm.clip_low, algorithm.clip_high, algorithm.agg) == (0.2, 0.28, "token-mean")
    assert (sampling.enabled, sampling.upper, sampling.lower, sampling.veto, sampling.mode) == (
        True,
        5.0,
        0.5,
        1e-4,
        "truncate",
    )
    assert (config.data.max_prompt_length, rollout.max_new_tokens) == (160 * 1024, 16 * 1024)
    assert (rollout.prompts_per_step, rollout.samples_per_prompt, train.mini_batches) == (128, 16, 1)
    assert (config.parallel.context, config.parallel.tensor) == (8, 1) and train.micro_batch_tokens == 180224
    assert (train.optimizer.lr, train.optimizer.warmup_steps, train.optimizer.weight_decay) == (2e-6, 5, 0.1)
    assert config.data.enable_thinking is None and not config.reward.overlong_penalty


TAGS = ("[paper", "[ours", "[GoLongRL")
# Hyper-parameters every example config must attribute (the line or, for a pair, the line above it).
HYPER_PARAMETERS = {
    "steps",
    "mini_batches",
    "micro_batch_tokens",
    "lr",
    "warmup_steps",
    "weight_decay",
    "clip_grad",
    "beta",
    "drift",
    "center",
    "length_normalize",
    "gate",
    "clip_low",
    "clip_high",
    "clip_c",
    "agg",
    "prompts_per_step",
    "samples_per_prompt",
    "temperature",
    "top_p",
    "max_new_tokens",
    "oversample_factor",
    "overlong_penalty",
    "overlong_filter",
    "max_prompt_length",
    "k",
    "tensor",
    "context",
    "every",
    "keep_last",
    "bf16",
    "recompute",
}
PAIRED = {"clip_high": "clip_low", "top_p": "temperature"}  # may share the tag of the line above


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(ROOT)) for p in EXAMPLES.glob("*/config.yaml")) + ["megatron_zcpo/cli/demo.yaml"]
)
def test_every_hyper_parameter_says_whether_it_is_the_papers_or_ours(path):
    lines = (ROOT / path).read_text().splitlines()
    untagged = []
    for number, line in enumerate(lines):
        match = re.match(r"^\s*(\w+):\s*[^\s#{]", line)
        sections = [
            lines[n]
            for n in range(number - 1, -1, -1)
            if len(lines[n]) - len(lines[n].lstrip()) < len(line) - len(line.lstrip())
        ][:1]
        above = (
            [lines[number - 1]]
            if match and re.match(rf"^\s*{PAIRED.get(match.group(1), '-')}:", lines[number - 1])
            else []
        )
        if (
            match
            and match.group(1) in HYPER_PARAMETERS
            and not any(tag in text for text in [line] + above + sections for tag in TAGS)
        ):
            untagged.append(f"{path}:{number + 1}: {line.strip()}")
    assert not untagged, "hyper-parameters without [paper: ...] / [ours: ...]:\n" + "\n".join(untagged)


def test_no_key_is_written_twice():
    """The run config loader refuses a repeated key (PyYAML alone keeps the last and drops the first
    silently: an example with a key twice would say one thing and run another)."""
    for path in sorted(EXAMPLES.glob("*/config.yaml")) + [ROOT / "megatron_zcpo" / "cli" / "demo.yaml"]:
        load_yaml(path)


def load_sglang_node():
    spec = importlib.util.spec_from_file_location("sglang_node", EXAMPLES / "common" / "sglang_node.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sglang_node_plans_two_tp4_servers_per_rollout_node():
    sglang_node = load_sglang_node()
    args = sglang_node.parse_args(
        ["--model-path", "/models/Qwen2.5-32B", "--nodes", "gpu05,gpu06,gpu07,gpu08", "--tp-size", "4"]
    )
    addresses = sglang_node.planned_addresses(sglang_node.server_config(args))
    assert len(addresses["server_urls"]) == 8
    assert addresses["server_urls"][:2] == ["http://gpu05:30000", "http://gpu05:30010"]
    assert addresses["router_url"] == "http://gpu05:29000"


@pytest.mark.parametrize(
    "script", sorted(str(p.relative_to(ROOT)) for p in EXAMPLES.glob("*/*.s*") if p.suffix in (".sbatch", ".sh"))
)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dockerfile_pins_its_base_image_and_installs_the_package_without_torch():
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base)
    assert "pip install" in text and "-e ." in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"runs/", ".venv/"} <= set(ignored)


def test_expert_parallelism_the_model_cannot_take_is_refused_before_any_rank_starts(tmp_path):
    from megatron_zcpo.recipe.layout_checks import layout_problems

    moe = run_config("qwen3-30b-a3b-zcpo", tmp_path, ["parallel.expert=3"])
    assert "parallel.expert=3 must divide the model's num_experts=128" in layout_problems(
        moe, MODELS["qwen3-30b-a3b-zcpo"], 48
    )
    dense = run_config("qwen2.5-32b-zcpo", tmp_path, ["parallel.expert=2"])
    assert "parallel.expert=2, parallel.expert_tensor=None: the qwen2 model has no experts" in layout_problems(
        dense, MODELS["qwen2.5-32b-zcpo"], 32
    )
    mla = run_config("moonlight-16b-a3b-zcpo", tmp_path, ["parallel.context=2"])
    assert any(
        problem.startswith("parallel.context=2: context parallelism is not supported with multi-latent attention")
        for problem in layout_problems(mla, MODELS["moonlight-16b-a3b-zcpo"], 16)
    )
