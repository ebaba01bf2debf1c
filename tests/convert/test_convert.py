"""Hugging Face <-> Megatron conversion: bit-exact round trips, logits at TP1/TP2/PP2, clear errors."""

import copy
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from megatron_zcpo.convert import mapping
from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron
from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]
SEQ = 16  # short sequences: rotary tables of both libraries agree to fp32 rounding there
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=16384)
# name -> (transformers family, config overrides, saved dtype, legacy (transformers<5) config style)
CASES = {
    "qwen2-gqa-tied": (
        "qwen2",
        dict(vocab_size=300, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
        torch.float32,
        False,
    ),
    "qwen2-mha-untied-bf16": (
        "qwen2",
        dict(vocab_size=300, num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=False),
        torch.bfloat16,
        False,
    ),
    "llama3-gqa-untied": (
        "llama",
        dict(
            vocab_size=400,
            num_hidden_layers=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
        ),
        torch.float32,
        True,
    ),
    "llama-mha-tied": (
        "llama",
        dict(vocab_size=260, num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=True),
        torch.float32,
        False,
    ),
    # Qwen3: per-head q/k norms, no bias, head_dim 32 != hidden/heads = 16 (as Qwen3-4B: 128 vs 80)
    "qwen3-gqa-tied-headdim": (
        "qwen3",
        dict(
            vocab_size=300,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ),
        torch.float32,
        False,
    ),
    "qwen3-mha-untied-bf16": (
        "qwen3",
        dict(vocab_size=300, num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=False),
        torch.bfloat16,
        True,
    ),
}
TOKENIZER_CASE = "qwen2-gqa-tied"
STREAMING_CASE = "llama3-gqa-untied"


def _save_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "question",
        "what",
        "is",
        "answer",
        "because",
        "twelve",
    ]
    vocab = {"<unk>": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(vocab) < vocab_size
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


def _to_legacy_config(directory: Path) -> None:
    """Rewrite config.json as transformers<5 writes it (rope_theta + rope_scaling, torch_dtype)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _make_hf_model(directory: Path, family: str, overrides: dict, dtype: torch.dtype, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SMALL, **copy.deepcopy(overrides)))  # transformers edits rope dicts
    with torch.no_grad():  # random norms and biases, so a swapped or dropped one changes the logits
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    # Several input shards exercise the index; bf16 checks dtypes survive bit for bit.
    model.to(dtype).save_pretrained(directory, max_shard_size="100KB")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    for seed, (name, (family, overrides, dtype, legacy)) in enumerate(CASES.items()):
        _make_hf_model(root / name / "hf", family, overrides, dtype, seed)
        if legacy:
            _to_legacy_config(root / name / "hf")
        if name == TOKENIZER_CASE:
            _save_tokenizer(root / name / "hf", overrides["vocab_size"])
    return root


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_zcpo.convert.verify import hf_logits

    return hf_logits(hf_dir, tokens)


# ----------------------------------------------------------------------------- rank functions


def round_trips_and_logits(root: Path, names, tokens) -> dict:
    """In this process (after setup_megatron): HF -> Megatron -> HF of every case under ``root`` and
    {case: the converted checkpoint's Megatron logits for ``tokens(vocab_size)``} at TP1/EP1."""
    from megatron_zcpo.checkpoint.io import load_model_checkpoint
    from megatron_zcpo.convert.checkpoint import convert_megatron_to_hf
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    logits = {}
    for name in names:
        model = convert_hf_to_megatron(root / name / "hf", root / name / "megatron")
        convert_megatron_to_hf(root / name / "megatron", root / name / "hf_back", max_shard_bytes=40_000)
        gpt = build_gpt_model(model, transformer_config(model))
        load_model_checkpoint(gpt, root / name / "megatron")
        logits[name] = megatron_logits(gpt, tokens(model.vocab_size))
    return logits


def _convert_round_trip_and_tp1_logits(rank, world, root, names):
    """In one process: HF -> Megatron -> HF for every case, TP1 logits, a refused foreign config."""
    import dataclasses

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    setup_megatron()
    root = Path(root)
    logits = round_trips_and_logits(root, names, _tokens)
    model = read_model_config(root / names[-1] / "megatron")
    other = dataclasses.replace(model, rope_theta=1.0, rms_norm_eps=1e-3)
    try:
        load_model_checkpoint(build_gpt_model(other, transformer_config(other)), root / names[-1] / "megatron")
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"logits": logits, "refusal": refusal, "streaming": _streaming_probe(root / STREAMING_CASE)}


def _streaming_probe(case_dir: Path) -> dict:
    """Which global tensors the writer asks for, and how many earlier ones are still alive then."""
    from megatron_zcpo.convert.checkpoint import save_streaming_checkpoint
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config

    model = mapping.model_config_from_hf(read_hf_config(case_dir / "hf"))
    requested, alive_at_request, produced = [], [], []

    with SafetensorsCheckpoint(case_dir / "hf") as source:

        def global_tensor(name):
            alive_at_request.append(sum(ref() is not None for ref in produced))
            requested.append(name)
            tensor = mapping.hf_to_megatron_tensor(name, source.tensor, model)
            produced.append(weakref.ref(tensor))
            return tensor

        save_streaming_checkpoint(
            case_dir / "streamed",
            model,
            global_tensor,
            lambda name: mapping.hf_to_megatron_tensor(name, source.meta, model),
        )
    return {"requested": requested, "max_alive": max(alive_at_request), "names": mapping.megatron_tensor_names(model)}


def resave_as_a_trainer(gpt, model, target: Path) -> None:
    """Save ``gpt`` (every rank) to ``target`` as a trainer saves: megatron-core's writer, {"model": ...}."""
    from megatron.core import dist_checkpointing

    from megatron_zcpo.checkpoint.io import write_model_config

    if torch.distributed.get_rank() == 0:
        target.mkdir()
        write_model_config(target, model)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(target))


def _parallel_logits(rank, world, tp, pp, root, names, resave):
    """Load every checkpoint at (TP, PP); optionally re-save one with megatron-core's own writer."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    setup_megatron(tensor_parallel=tp, pipeline_parallel=pp)
    root, logits = Path(root), {}
    for name in names:
        model = read_model_config(root / name / "megatron")
        gpt = build_gpt_model(model, transformer_config(model, tensor_parallel=tp, pipeline_parallel=pp))
        load_model_checkpoint(gpt, root / name / "megatron")
        logits[name] = megatron_logits(gpt, _tokens(model.vocab_size))
        if name == resave:  # padded vocabulary of this TP
            resave_as_a_trainer(gpt, model, root / name / f"resaved_tp{tp}_pp{pp}")
    keep = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return logits if keep else None


# ----------------------------------------------------------------------------- spawned runs


@pytest.fixture(scope="module")
def converted(workdir):
    return run_distributed(_convert_round_trip_and_tp1_logits, 1, str(workdir), list(CASES))[0]


@pytest.fixture(scope="module")
def tp2_logits(workdir, converted):
    results = run_distributed(_parallel_logits, 2, 2, 1, str(workdir), list(CASES), "llama3-gqa-untied")
    return next(r for r in results if r is not None)


@pytest.fixture(scope="module")
def pp2_logits(workdir, converted):
    results = run_distributed(_parallel_logits, 2, 1, 2, str(workdir), list(CASES), None)
    return next(r for r in results if r is not None)


def _assert_same_hf_checkpoint(expected_dir: Path, actual_dir: Path) -> None:
    with SafetensorsCheckpoint(expected_dir) as expected, SafetensorsCheckpoint(actual_dir) as actual:
        assert sorted(actual.names()) == sorted(expected.names())
        for tensor_name in expected.names():
            a, b = actual.tensor(tensor_name), expected.tensor(tensor_name)
            assert a.dtype == b.dtype and a.shape == b.shape, tensor_name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{tensor_name} differs"
    assert json.loads((actual_dir / "config.json").read_text()) == json.loads(
        (expected_dir / "config.json").read_text()
    )


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_reproduces_every_tensor_and_the_config(workdir, converted, name):
    _assert_same_hf_checkpoint(workdir / name / "hf", workdir / name / "hf_back")
    index = json.loads((workdir / name / "hf_back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # written in several shards
    assert (workdir / name / "hf_back" / "generation_config.json").is_file()
    if name == TOKENIZER_CASE:
        assert (workdir / name / "hf_back" / "tokenizer.json").read_bytes() == (
            workdir / name / "hf" / "tokenizer.json"
        ).read_bytes()


@pytest.mark.parametrize("layout", ["TP1", "TP2", "PP2"])
def test_megatron_logits_match_transformers(workdir, converted, request, layout):
    logits = {"TP1": converted["logits"], "TP2": None, "PP2": None}[layout]
    if logits is None:
        logits = request.getfixturevalue({"TP2": "tp2_logits", "PP2": "pp2_logits"}[layout])
    for name, (_, overrides, _, _) in CASES.items():
        reference = _hf_logits(workdir / name / "hf", _tokens(overrides["vocab_size"]))
        assert logits[name].shape == reference.shape, name
        assert reference.abs().max() > 0.1  # a real signal, not an all-zero model
        difference = (logits[name] - reference).abs().max().item()
        assert difference < 1e-4, f"{name} at {layout}: max abs logit difference {difference:.2e}"


def test_writer_streams_one_global_tensor_at_a_time(converted):
    probe = converted["streaming"]
    # Every tensor is produced exactly once (SwiGLU's two stored halves share one read) ...
    assert sorted(probe["requested"]) == sorted(probe["names"])
    # ... and when the next one is requested, no earlier one is still held.
    assert probe["max_alive"] == 0


def test_checkpoint_of_another_architecture_is_refused(converted):
    assert converted["refusal"] is not None
    assert "rope_theta" in converted["refusal"] and "rms_norm_eps" in converted["refusal"]


def _run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_tool_converts_a_megatron_saved_tp2_checkpoint_back_bit_exact(workdir, tp2_logits, tmp_path):
    # Saved by megatron-core's own writer from a TP=2 model: padded vocabulary 512, not 400.
    result = _run_tool(
        "convert_megatron_to_hf.py",
        "--ckpt",
        str(workdir / "llama3-gqa-untied" / "resaved_tp2_pp1"),
        "--out",
        str(tmp_path / "hf"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with (
        SafetensorsCheckpoint(tmp_path / "hf") as back,
        SafetensorsCheckpoint(workdir / "llama3-gqa-untied" / "hf") as original,
    ):
        assert sorted(back.names()) == sorted(original.names())
        for tensor_name in original.names():
            assert torch.equal(back.tensor(tensor_name), original.tensor(tensor_name)), tensor_name


def test_tool_verify_reports_the_logit_difference_last(workdir, tmp_path):
    result = _run_tool(
        "convert_hf_to_megatron.py",
        "--hf-dir",
        str(workdir / TOKENIZER_CASE / "hf"),
        "--out",
        str(tmp_path / "megatron"),
        "--pp",
        "2",
        "--verify",
        "--tolerance",
        "1e-4",
        "--seq-length",
        str(SEQ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("max abs logit difference:"), result.stdout
    assert float(last.split(":")[1]) < 1e-4


# ----------------------------------------------------------------------------- in-process checks


def test_fused_qkv_is_megatrons_interleaved_per_group_layout():
    model = ModelConfig(
        family="llama",
        vocab_size=10,
        hidden_size=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=3,
        num_layers=1,
        intermediate_size=4,
    )
    d, per_group = model.head_dim, 3
    q = torch.arange(6 * d * 8, dtype=torch.float64).reshape(6 * d, 8)
    k = -1 - torch.arange(2 * d * 8, dtype=torch.float64).reshape(2 * d, 8)
    v = 1000 + torch.arange(2 * d * 8, dtype=torch.float64).reshape(2 * d, 8)
    hf = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
    }
    fused = mapping.hf_to_megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, model)
    groups = fused.reshape(2, per_group + 2, d, 8)
    for g in range(2):
        torch.testing.assert_close(
            groups[g, :per_group], q.reshape(6, d, 8)[g * per_group : (g + 1) * per_group], rtol=0, atol=0
        )
        torch.testing.assert_close(groups[g, per_group], k.reshape(2, d, 8)[g], rtol=0, atol=0)
        torch.testing.assert_close(groups[g, per_group + 1], v.reshape(2, d, 8)[g], rtol=0, atol=0)
    back = dict(mapping.megatron_to_hf_tensors("decoder.layers.0.self_attention.linear_qkv.weight", fused, model))
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def _v5_config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "initializer_range": 0.02,
        "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0},
    }
    config.update(changes)
    return config


def test_config_round_trips_in_both_rope_styles():
    v5 = _v5_config()
    legacy = {key: value for key, value in v5.items() if key not in ("rope_parameters", "dtype")}
    legacy.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), torch_dtype="bfloat16")
    model = mapping.model_config_from_hf(v5)
    assert model == mapping.model_config_from_hf(legacy)
    assert (model.family, model.rope_theta, model.qkv_bias, model.head_dim) == ("llama", 500000.0, False, 16)
    assert mapping.hf_config_from_model_config(model, base=v5) == v5
    assert mapping.hf_config_from_model_config(model, base=legacy) == legacy
    assert mapping.model_config_from_hf(mapping.hf_config_from_model_config(model)) == model


@pytest.mark.parametrize(
    "changes,named",
    [
        (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "mistral"),
        (dict(architectures=["Qwen2ForCausalLM"]), "Qwen2ForCausalLM"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "yarn"),
        (dict(rope_parameters={**LLAMA3_ROPE, "low_freq_factor": 2.0, "rope_theta": 1e6}), "low_freq_factor"),
    ],
)
def test_unsupported_configs_are_refused_by_name(changes, named):
    with pytest.raises((KeyError, ValueError), match=named):
        mapping.model_config_from_hf(_v5_config(**changes))


def test_wrong_megatron_tensors_are_named():
    model = mapping.model_config_from_hf(_v5_config())
    with pytest.raises(ValueError, match="linear_fc1"):
        mapping.megatron_to_hf_tensors("decoder.layers.1.mlp.linear_fc1.weight", torch.zeros(96, 64), model)
    with pytest.raises(KeyError, match="decoder.layers.2.mlp.linear_fc2.weight"):
        mapping.megatron_to_hf_tensors("decoder.layers.2.mlp.linear_fc2.weight", torch.zeros(64, 96), model)
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight"):  # a padded vocabulary
        mapping.megatron_to_hf_tensors("embedding.word_embeddings.weight", torch.zeros(256, 64), model)


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import save_file

    with SafetensorsCheckpoint(src) as checkpoint:
        tensors = {name: checkpoint.tensor(name) for name in checkpoint.names()}
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


@pytest.mark.parametrize(
    "edit,error,named",
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), KeyError, "model.layers.1.self_attn.k_proj.weight"),
        (
            lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 32)),
            ValueError,
            "model.layers.0.mlp.up_proj.weight",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)),
            ValueError,
            "model.layers.0.self_attn.q_norm.weight",
        ),
    ],
)
def test_broken_hf_checkpoints_fail_naming_the_tensor_before_writing(workdir, tmp_path, edit, error, named):
    broken = _edited_copy(workdir / "qwen2-gqa-tied" / "hf", tmp_path / "broken", edit)
    with pytest.raises(error, match=named.replace(".", r"\.")):
        convert_hf_to_megatron(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
