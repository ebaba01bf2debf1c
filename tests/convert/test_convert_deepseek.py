"""DeepSeek-V3 conversion on tiny models built with transformers' own DeepseekV3ForCausalLM: bit-exact round
trips (also after megatron-core re-saves at TP2 x PP2 (uneven) x EP2), logits equal at TP1 and at that
layout, blockwise-FP8 weights dequantised, multi-token-prediction layers dropped or kept by request."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_zcpo.convert import mapping
from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint, read_hf_config
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.tiny_deepseek import ARCHITECTURES, TINY, YARN, make_hf_model
from tests.convert.test_convert import resave_as_a_trainer

REPO = Path(__file__).resolve().parents[2]
SEQ = 16
CASES = ARCHITECTURES
FP8_CASE = "dsv3-fp8-mtp"  # dsv3-yarn-groups' architecture, quantised in 16 x 16 blocks, one MTP layer
FP8_BLOCK = 16


def quantize_block_fp8(weight: torch.Tensor, block: int):
    """(float8 weight, float32 scale_inv per block) as DeepSeek stores them: scale = block amax / 448."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // block), -(-cols // block))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scales[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scales


def dequantize_reference(quantized: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Block by block, in float32, rounded to bf16 once (DeepSeek's fp8_cast_bf16.py)."""
    out = torch.empty(quantized.shape, dtype=torch.bfloat16)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            cells = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[cells] = (quantized[cells].float() * scales[i, j]).to(torch.bfloat16)
    return out


def _make_fp8_mtp_model(directory: Path) -> dict:
    """dsv3-yarn-groups' architecture with every projection and expert in block FP8, plus one
    multi-token-prediction layer (model.layers.3.*, some of it FP8 too). Returns the expected bf16
    value of every quantised tensor."""
    from safetensors.torch import save_file

    overrides, _ = CASES["dsv3-yarn-groups"]
    make_hf_model(directory / "plain", overrides, torch.bfloat16, seed=7)
    with SafetensorsCheckpoint(directory / "plain") as plain:
        state = {name: plain.tensor(name) for name in plain.names()}
    last = overrides["num_hidden_layers"] - 1
    mtp = overrides["num_hidden_layers"]
    for name in list(state):  # the MTP layer: a decoder layer plus its projection and norms
        if name.startswith(f"model.layers.{last}."):
            state[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = state[name].clone()
    h = TINY["hidden_size"]
    state[f"model.layers.{mtp}.eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.{mtp}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    expected = {}
    for name in list(state):
        if name.endswith("proj.weight") and state[name].dim() == 2:
            quantized, scales = quantize_block_fp8(state[name], FP8_BLOCK)
            state[name], state[name + "_scale_inv"] = quantized, scales
            expected[name] = dequantize_reference(quantized, scales, FP8_BLOCK)
    target = directory / "hf"
    target.mkdir()
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = read_hf_config(directory / "plain")
    config.update(
        num_nextn_predict_layers=1,
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
    )
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return expected


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_deepseek")
    for seed, (name, (overrides, dtype)) in enumerate(CASES.items()):
        make_hf_model(root / name / "hf", overrides, dtype, seed)
    return root


@pytest.fixture(scope="module")
def fp8_expected(workdir):
    return _make_fp8_mtp_model(workdir / FP8_CASE)


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))


# ----------------------------------------------------------------------------- rank functions


def _convert_all(rank, world, root, names, fp8_case):
    """One process: HF -> Megatron -> HF for every case (the FP8 one three ways: MTP unset, dropped,
    kept) and the Megatron logits at TP1."""
    from megatron_zcpo.checkpoint.io import load_model_checkpoint
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from tests.convert.test_convert import round_trips_and_logits

    setup_megatron()
    root = Path(root)
    logits = round_trips_and_logits(root, names, _tokens)
    case = root / fp8_case
    try:
        convert_hf_to_megatron(case / "hf", case / "unset")
        refusal = None
    except ValueError as error:
        refusal = str(error)
    for choice in ("drop", "keep"):
        model = convert_hf_to_megatron(case / "hf", case / f"megatron_{choice}", mtp=choice)
        convert_megatron_to_hf(case / f"megatron_{choice}", case / f"back_{choice}")
    gpt = build_gpt_model(model, transformer_config(model))
    load_model_checkpoint(gpt, case / "megatron_keep")
    logits[fp8_case] = megatron_logits(gpt, _tokens(model.vocab_size))
    return {"logits": logits, "refusal": refusal}


def _layout_logits_and_resave(rank, world, root, names, resave):
    """TP2 x PP2 (1 + 2 layers) x EP2 (ETP1): logits of every case; one re-saved by megatron-core."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    layout = dict(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, expert_tensor_parallel=1)
    setup_megatron(**layout)
    root, logits = Path(root), {}
    for name in names:
        model = read_model_config(root / name / "megatron")
        stages = {"first_stage_layers": 1} if model.num_layers == 3 else {}
        gpt = build_gpt_model(model, transformer_config(model, **layout, **stages))
        load_model_checkpoint(gpt, root / name / "megatron")
        logits[name] = megatron_logits(gpt, _tokens(model.vocab_size))
        if name == resave:
            target = root / name / "resaved"
            resave_as_a_trainer(gpt, model, target)
    keep = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return logits if keep else None


@pytest.fixture(scope="module")
def converted(workdir, fp8_expected):
    return run_distributed(_convert_all, 1, str(workdir), list(CASES), FP8_CASE)[0]


@pytest.fixture(scope="module")
def layout(workdir, converted):
    results = run_distributed(_layout_logits_and_resave, 4, str(workdir), list(CASES), "dsv3-yarn-groups")
    return next(r for r in results if r is not None)


def _tensors(directory: Path) -> dict:
    with SafetensorsCheckpoint(directory) as checkpoint:
        return {name: checkpoint.tensor(name) for name in checkpoint.names()}


def _assert_bit_exact(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(
            actual[name].view(torch.uint8), tensor.view(torch.uint8)
        ), name


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bit_exact_with_the_config(workdir, converted, name):
    original = _tensors(workdir / name / "hf")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in original
    assert original["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # kept in fp32
    _assert_bit_exact(_tensors(workdir / name / "hf_back"), original)
    config = json.loads((workdir / name / "hf" / "config.json").read_text())
    assert json.loads((workdir / name / "hf_back" / "config.json").read_text()) == config
    model = mapping.model_config_from_hf(config)
    assert mapping.model_config_from_hf(mapping.hf_config_from_model_config(model)) == model


def test_megatron_re_saved_at_tp2_pp2_uneven_ep2_converts_back_bit_exact(workdir, layout, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert_megatron_to_hf.py"),
            "--ckpt",
            str(workdir / "dsv3-yarn-groups" / "resaved"),
            "--out",
            str(tmp_path / "hf"),
            "--hf-files",
            str(workdir / "dsv3-yarn-groups" / "hf"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_bit_exact(_tensors(tmp_path / "hf"), _tensors(workdir / "dsv3-yarn-groups" / "hf"))


@pytest.mark.parametrize("where", ["TP1", "TP2xPP2xEP2"])
def test_logits_match_transformers(workdir, converted, request, where):
    from megatron_zcpo.convert.verify import hf_logits

    logits = converted["logits"] if where == "TP1" else request.getfixturevalue("layout")
    for name, (overrides, _dtype) in CASES.items():
        reference = hf_logits(workdir / name / "hf", _tokens(overrides["vocab_size"]))
        assert reference.abs().max() > 0.1
        difference = (logits[name] - reference).abs().max().item()
        # bf16 weights run in fp32 on both sides: the same values, so the same bound
        assert difference < 1e-4, f"{name} at {where}: max abs logit difference {difference:.2e}"


def test_fp8_weights_are_dequantised_block_by_block(workdir, converted, fp8_expected):
    back = _tensors(workdir / FP8_CASE / "back_keep")
    for name, expected in fp8_expected.items():
        assert torch.equal(back[name], expected), name
    assert not any(name.endswith("_scale_inv") for name in back)
    config = json.loads((workdir / FP8_CASE / "back_keep" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    from megatron_zcpo.convert.verify import hf_logits

    reference = hf_logits(workdir / FP8_CASE / "back_drop", _tokens(300))
    assert (converted["logits"][FP8_CASE] - reference).abs().max().item() < 1e-4


def test_mtp_layers_are_dropped_or_kept_only_when_asked(workdir, converted, fp8_expected):
    assert "--mtp drop" in converted["refusal"] and "model.layers.3." in converted["refusal"]
    assert not (workdir / FP8_CASE / "unset").exists()
    dropped, kept = _tensors(workdir / FP8_CASE / "back_drop"), _tensors(workdir / FP8_CASE / "back_keep")
    mtp = sorted(name for name in kept if name.startswith("model.layers.3."))
    assert "model.layers.3.eh_proj.weight" in mtp and not any(n.startswith("model.layers.3.") for n in dropped)
    assert sorted(kept) == sorted(set(dropped) | set(mtp))
    assert torch.equal(kept["model.layers.3.eh_proj.weight"], fp8_expected["model.layers.3.eh_proj.weight"])
    configs = [json.loads((workdir / FP8_CASE / f"back_{c}" / "config.json").read_text()) for c in ("drop", "keep")]
    assert [c["num_nextn_predict_layers"] for c in configs] == [0, 1]


def test_deepseek_fields_megatron_cannot_express_are_refused():
    from megatron_zcpo.megatron.model import ModelConfig

    config = json.loads(json.dumps(_tiny_config()))
    model = mapping.model_config_from_hf(config)
    assert model.family == "deepseek_v3" and model.is_mla and model.moe_layer_pattern == [0, 1, 1]
    for field, value, message in (
        ("topk_method", "greedy", "topk_method='greedy'"),
        ("scoring_func", "softmax", "scoring_func='softmax'"),
        ("rope_interleave", False, "rope_interleave=False"),
        ("topk_group", 1, "router_group_topk=1"),  # top-4 != 2 x 1
        ("norm_topk_prob", False, "norm_topk_prob=false"),
        ("attention_bias", True, "attention_bias=True"),
    ):
        with pytest.raises(ValueError, match=message):
            mapping.model_config_from_hf({**config, field: value})
    with pytest.raises(ValueError, match="quantization_config"):
        from megatron_zcpo.convert.fp8 import block_size_of

        block_size_of({**config, "quantization_config": {"quant_method": "compressed-tensors"}})
    assert mapping.model_config_from_hf({**config, "model_type": "kimi_k2"}).family == "deepseek_v3"
    with pytest.raises(ValueError, match="parallel.context=2: context parallelism is not supported"):
        from megatron_zcpo.megatron.model import transformer_config

        transformer_config(ModelConfig(**model.to_dict()), context_parallel=2)


def _tiny_config() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 300,
        "num_hidden_layers": 3,
        **{k: v for k, v in TINY.items() if k != "num_mtp_layers"},
        "q_lora_rank": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"},
        "rope_theta": 10000.0,
    }


def test_parameter_counts_match_transformers(workdir):
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in CASES:
        model = mapping.model_config_from_hf(read_hf_config(workdir / name / "hf"))
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(workdir / name / "hf"))
        assert model.num_parameters == sum(p.numel() for p in hf.parameters()), name
        inactive = (model.num_experts - model.num_experts_per_tok) * model.expert_parameters()
        assert model.num_parameters - model.num_active_parameters == sum(model.moe_layer_pattern) * inactive


def test_a_cast_to_bf16_keeps_the_correction_bias_float32():
    """``convert_megatron_to_hf --dtype bfloat16`` and a push cast to bf16: every tensor bf16 but the bias."""
    model = mapping.model_config_from_hf(_tiny_config())
    stream = [
        ("decoder.layers.1.mlp.router.weight", torch.randn(8, 64)),
        ("decoder.layers.1.mlp.router.expert_bias", torch.randn(8)),
    ]
    cast = dict(mapping.megatron_to_hf_stream(stream, model, torch.bfloat16))
    assert cast["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert cast["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert torch.equal(cast["model.layers.1.mlp.gate.e_score_correction_bias"], stream[1][1])
