"""The trainer's start-up check against transformers catches a scrambled fused layout at TP2 with SP."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed

HF_CONFIG = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    initializer_range=0.2,
)  # large weights: a swapped gate/up moves the log-probs visibly


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("startup_check") / "hf"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**HF_CONFIG)).save_pretrained(directory)
    return directory


def _gaps(rank, world, hf_dir, tp):
    """The check's gap with the converted weights, and its error with gate/up swapped in layer 0."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.convert.checkpoint import model_config_at
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
    from megatron_zcpo.convert.mapping import hf_to_megatron_tensors
    from megatron_zcpo.convert.verify import check_policy_against_hf
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(tensor_parallel=tp, seed=3)
    model = model_config_at(hf_dir)
    weights = dict(hf_to_megatron_tensors(SafetensorsCheckpoint(hf_dir).tensor, model))

    def trainer(initial):
        return PolicyTrainer(
            model,
            AlgorithmConfig(name="zcpo"),
            TrainConfig(),
            initial_weights=initial,
            parallel=ParallelConfig(tensor=tp, sequence_parallel=tp > 1),
        )

    gap = check_policy_against_hf(trainer(weights), hf_dir)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = weights[name].chunk(2)
    try:
        check_policy_against_hf(trainer({**weights, name: torch.cat([up, gate])}), hf_dir)
    except RuntimeError as error:
        return gap, str(error)
    return gap, None


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2)], ids=["TP1", "TP2-SP"])
def test_startup_check_passes_converted_weights_and_catches_swapped_gate_up(hf_dir, tp, world):
    for gap, error in run_distributed(_gaps, world, str(hf_dir), tp):
        assert gap < 1e-4
        assert error is not None and "max |log-prob difference|" in error and f"TP={tp}" in error, error


def test_startup_check_default_is_on_for_hugging_face_directories(hf_dir, tmp_path):
    from megatron_zcpo.convert.checkpoint import model_config_at
    from megatron_zcpo.convert.verify import startup_check_due

    model = model_config_at(hf_dir)
    assert startup_check_due(None, str(hf_dir), model)
    assert not startup_check_due(False, str(hf_dir), model)
    assert not startup_check_due(None, str(tmp_path), model)  # e.g. a converted Megatron checkpoint
    assert not startup_check_due(None, None, model)
    with pytest.raises(ValueError, match="train.verify_against_hf"):
        startup_check_due(True, str(tmp_path), model)


def test_convert_tool_verifies_at_tp2_with_sequence_parallelism(hf_dir, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [
            sys.executable,
            str(root / "tools" / "convert_hf_to_megatron.py"),
            "--hf-dir",
            str(hf_dir),
            "--out",
            str(tmp_path / "megatron"),
            "--tp",
            "2",
            "--sequence-parallel",
            "--verify",
            "--tolerance",
            "1e-4",
            "--seq-length",
            "16",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "TP=2 PP=1 SP=True" in lines[-2] and float(lines[-1].split(":")[1]) < 1e-4, result.stdout
