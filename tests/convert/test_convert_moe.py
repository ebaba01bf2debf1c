"""Mixture-of-experts conversion: Qwen3-MoE / Qwen2-MoE round trips bit for bit, logits at EP1/EP2/TP2xEP2, clear refusals."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_zcpo.convert import mapping
from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
from megatron_zcpo.testing import run_distributed
from tests.convert.test_convert import resave_as_a_trainer

REPO = Path(__file__).resolve().parents[2]
SEQ = 16
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    num_experts=4,
    num_experts_per_tok=2,
)
# name -> (transformers family, config overrides, saved dtype)
CASES = {
    # Qwen3-MoE as released: renormalised top-k, every layer sparse, q/k norms, head_dim != hidden/heads
    "qwen3moe-untied": (
        "qwen3_moe",
        dict(
            vocab_size=300,
            num_hidden_layers=2,
            head_dim=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
        torch.float32,
    ),
    # a dense first layer (mlp_only_layers), no renormalisation (pre-softmax), tied, stored in bf16
    "qwen3moe-dense-first-bf16": (
        "qwen3_moe",
        dict(
            vocab_size=260,
            num_hidden_layers=2,
            head_dim=16,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            tie_word_embeddings=True,
        ),
        torch.bfloat16,
    ),
    # Qwen2-MoE: q/k/v biases and a sigmoid-gated shared expert
    "qwen2moe-shared-expert": (
        "qwen2_moe",
        dict(
            vocab_size=300,
            num_hidden_layers=2,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        torch.float32,
    ),
}
RESAVED = "qwen3moe-untied"


def _make_hf_model(directory: Path, family: str, overrides: dict, dtype: torch.dtype, seed: int) -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls = {
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, **copy.deepcopy(overrides)))
    with torch.no_grad():  # every tensor random: a swapped expert, router row or norm changes the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # well separated router logits: no near-ties in the top-k
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    model.to(dtype).save_pretrained(directory, max_shard_size="100KB")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_moe")
    for seed, (name, (family, overrides, dtype)) in enumerate(CASES.items()):
        _make_hf_model(root / name / "hf", family, overrides, dtype, seed)
    return root


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))


# ----------------------------------------------------------------------------- rank functions


def _convert_round_trip_and_logits(rank, world, root, names):
    """One process: HF -> Megatron -> HF for every case and the Megatron logits at EP1."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from tests.convert.test_convert import round_trips_and_logits

    setup_megatron()
    return round_trips_and_logits(Path(root), names, _tokens)


def _expert_parallel_logits(rank, world, root, names, resave):
    """Load every checkpoint at EP2 (two ranks, one expert half each); re-save one with megatron-core's writer."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import named_global_parameters

    setup_megatron(expert_parallel=2)
    root, logits = Path(root), {}
    for name in names:
        model = read_model_config(root / name / "megatron")
        gpt = build_gpt_model(model, transformer_config(model, expert_parallel=2))
        load_model_checkpoint(gpt, root / name / "megatron")
        logits[name] = megatron_logits(gpt, _tokens(model.vocab_size))
        if name == resave:
            target = root / name / "resaved_ep2"
            resave_as_a_trainer(gpt, model, target)
            experts = sorted(
                {
                    n.split(".mlp.experts.local_experts.")[1].split(".")[0]
                    for n, _ in named_global_parameters(gpt)
                    if ".local_experts." in n
                }
            )
    return {"logits": logits if ps.get_data_parallel_rank() == 0 else None, "experts": experts}


# ----------------------------------------------------------------------------- spawned runs


@pytest.fixture(scope="module")
def converted(workdir):
    return run_distributed(_convert_round_trip_and_logits, 1, str(workdir), list(CASES))[0]


@pytest.fixture(scope="module")
def ep2(workdir, converted):
    return run_distributed(_expert_parallel_logits, 2, str(workdir), list(CASES), RESAVED)


def _run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_reproduces_every_tensor_and_the_config(workdir, converted, name):
    with (
        SafetensorsCheckpoint(workdir / name / "hf") as expected,
        SafetensorsCheckpoint(workdir / name / "hf_back") as actual,
    ):
        assert sorted(actual.names()) == sorted(expected.names())
        assert any(".mlp.experts.3.down_proj" in n for n in expected.names())
        for tensor_name in expected.names():
            a, b = actual.tensor(tensor_name), expected.tensor(tensor_name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), tensor_name
    config = json.loads((workdir / name / "hf" / "config.json").read_text())
    assert json.loads((workdir / name / "hf_back" / "config.json").read_text()) == config


def test_logits_match_transformers_at_ep1_and_ep2(workdir, converted, ep2):
    ep2_logits = next(r["logits"] for r in ep2 if r["logits"] is not None)
    assert [r["experts"] for r in ep2] == [["0", "1"], ["2", "3"]]  # each rank holds its half, global indices
    for name, (_, overrides, _) in CASES.items():
        from megatron_zcpo.convert.verify import hf_logits

        reference = hf_logits(workdir / name / "hf", _tokens(overrides["vocab_size"]))
        assert reference.abs().max() > 0.1
        for layout, logits in (("EP1", converted[name]), ("EP2", ep2_logits[name])):
            difference = (logits - reference).abs().max().item()
            assert difference < 1e-4, f"{name} at {layout}: max abs logit difference {difference:.2e}"


def test_expert_parallel_checkpoint_converts_back_bit_exact(workdir, ep2, tmp_path):
    """Saved by megatron-core's own writer at EP2 (each rank its experts), read back in one process."""
    result = _run_tool(
        "convert_megatron_to_hf.py", "--ckpt", str(workdir / RESAVED / "resaved_ep2"), "--out", str(tmp_path / "hf")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with SafetensorsCheckpoint(tmp_path / "hf") as back, SafetensorsCheckpoint(workdir / RESAVED / "hf") as original:
        assert sorted(back.names()) == sorted(original.names())
        for tensor_name in original.names():
            assert torch.equal(back.tensor(tensor_name), original.tensor(tensor_name)), tensor_name


def test_tool_verifies_at_tp2_x_ep2(workdir, tmp_path):
    """--tp 2 --ep 2 --etp 1 (the experts split over the TP ranks, as slime's tp4/ep8/etp1), with SP."""
    result = _run_tool(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(workdir / "qwen2moe-shared-expert" / "hf"),
        "--out",
        str(tmp_path / "megatron"),
        "--tp",
        "2",
        "--ep",
        "2",
        "--etp",
        "1",
        "--sequence-parallel",
        "--verify",
        "--tolerance",
        "1e-4",
        "--seq-length",
        str(SEQ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EP=2 ETP=1" in result.stdout and "active" in result.stdout
    assert float(result.stdout.strip().splitlines()[-1].split(":")[1]) < 1e-4


def test_experts_not_divisible_by_expert_parallelism_are_refused(workdir):
    from megatron_zcpo.convert.checkpoint import check_parallel_layout
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.megatron.model import transformer_config

    model = mapping.model_config_from_hf(read_hf_config(workdir / "qwen3moe-untied" / "hf"))
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by expert parallelism 3"):
        check_parallel_layout(model, 1, 1, expert_parallel=3)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible by expert tensor parallelism 3"):
        check_parallel_layout(model, 1, 1, expert_parallel=2, expert_tensor_parallel=3)
    with pytest.raises(ValueError, match=r"parallel\.expert=3 must divide the model's num_experts=4"):
        transformer_config(model, expert_parallel=3)
    result = _run_tool(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(workdir / "qwen3moe-untied" / "hf"),
        "--out",
        str(workdir / "never"),
        "--ep",
        "3",
    )
    assert result.returncode != 0 and "not divisible by expert parallelism 3" in result.stderr
    assert not (workdir / "never").exists()


def test_moe_config_fields_round_trip_and_count_active_parameters(workdir):
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in CASES:
        config = json.loads((workdir / name / "hf" / "config.json").read_text())
        model = mapping.model_config_from_hf(config)
        assert mapping.hf_config_from_model_config(model, base=config) == config
        assert mapping.model_config_from_hf(mapping.hf_config_from_model_config(model)) == model
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(workdir / name / "hf"))
        assert model.num_parameters == sum(p.numel() for p in hf.parameters())
        per_expert = model.expert_parameters()
        moe_layers = sum(model.moe_layer_pattern)
        assert model.num_parameters - model.num_active_parameters == moe_layers * 2 * per_expert  # 4 experts, top-2


def test_unknown_expert_tensors_are_named():
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    model = mapping.model_config_from_hf(config)
    with pytest.raises(KeyError, match="local_experts.4"):
        mapping.megatron_to_hf_tensors(
            "decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight", torch.zeros(64, 32), model
        )
    with pytest.raises(ValueError, match=r"mlp\.experts\.local_experts\.1\.linear_fc1"):
        mapping.megatron_to_hf_tensors(
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", torch.zeros(32, 64), model
        )
    with pytest.raises(KeyError, match="num_experts"):
        mapping.model_config_from_hf({k: v for k, v in config.items() if k != "num_experts"})


def test_transformer_engine_grouped_expert_names_map_to_global_indices():
    """TE's grouped MLP names experts ``linear_fc1.weight{j}``; SequentialMLP ``local_experts.{j}``: same global name."""
    from megatron_zcpo.megatron.weights import global_name

    assert (
        global_name("decoder.layers.1.mlp.experts.linear_fc1.weight3", 4, expert_offset=8)
        == "decoder.layers.5.mlp.experts.local_experts.11.linear_fc1.weight"
    )
    assert (
        global_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", 4, expert_offset=8)
        == "decoder.layers.5.mlp.experts.local_experts.11.linear_fc2.weight"
    )
    assert global_name("decoder.layers.0.mlp.router.weight", 2, expert_offset=8) == "decoder.layers.2.mlp.router.weight"
