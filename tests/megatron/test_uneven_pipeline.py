"""Uneven pipeline stages (megatron-core's num_layers_in_first_pipeline_stage): a 5-layer model at PP2 as
3 + 2 layers holds 3 and 2 layers, streams its weights whole under their global names, computes one
process's logits and converts both ways bit-exact (the trainer's step: tests/training/test_trainer_uneven_stages.py)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_zcpo.megatron.model import pipeline_stage_layers
from megatron_zcpo.testing import run_distributed
from tests.convert.test_convert import _assert_same_hf_checkpoint, _hf_logits, _make_hf_model, _tokens
from tests.megatron.test_parallel import MODEL, _reference_weights

FIVE_LAYERS = dataclasses.replace(MODEL, num_layers=5)
FIRST_STAGE = 3  # PP2 as 3 + 2 layers
HF_FIVE_LAYERS = dict(vocab_size=300, num_hidden_layers=5, num_key_value_heads=2, tie_word_embeddings=False)


def test_stage_layers_follow_megatron_core():
    assert pipeline_stage_layers(5, 2, first_stage_layers=3) == [3, 2]
    assert pipeline_stage_layers(5, 2, last_stage_layers=3) == [2, 3]
    assert pipeline_stage_layers(94, 8, 11, 11) == [11] + [12] * 6 + [11]
    with pytest.raises(ValueError, match=r"parallel.pipeline=8 does not divide num_layers=94: e.g. "):
        pipeline_stage_layers(94, 8)
    with pytest.raises(ValueError, match="parallel.first_stage_layers=10, parallel.last_stage_layers=10 leaves 74"):
        pipeline_stage_layers(94, 8, 10, 10)


def test_the_converters_check_uneven_stages_under_their_flags():
    from megatron_zcpo.convert.checkpoint import check_parallel_layout
    from megatron_zcpo.convert.presets import preset_model_config

    qwen3_235b = preset_model_config("Qwen3-235B-A22B")
    with pytest.raises(ValueError, match="--pp=8 does not divide num_layers=94: e.g. --first-stage-layers=11 and"):
        check_parallel_layout(qwen3_235b, 4, 8, 16, 1)
    check_parallel_layout(qwen3_235b, 4, 8, 16, 1, first_stage_layers=11, last_stage_layers=11)


def _weights_and_convert_at_pp1(rank, world, hf_dir, ckpt_dir):
    """In one process: seeded global weights of the 5-layer model (test_parallel's), HF -> Megatron,
    and the converted checkpoint's PP1 logits."""
    from megatron_zcpo.checkpoint.io import load_model_checkpoint
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    weights = _reference_weights(rank, world, FIVE_LAYERS)
    model = convert_hf_to_megatron(hf_dir, ckpt_dir)
    gpt = build_gpt_model(model, transformer_config(model))
    load_model_checkpoint(gpt, ckpt_dir)
    return weights, megatron_logits(gpt, _tokens(model.vocab_size))


def _uneven_rank(rank, world, model_config, weights, ckpt_dir, resaved_dir):
    """At PP2 with 3 + 2 layers: the weight stream to rank 0, the converted checkpoint's logits and its
    re-save by megatron-core's writer."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config, write_model_config
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0, load_global_state_dict

    setup_megatron(pipeline_parallel=2)
    gpt = build_gpt_model(
        model_config, transformer_config(model_config, pipeline_parallel=2, first_stage_layers=FIRST_STAGE)
    )
    load_global_state_dict(gpt, weights)
    streamed = {name: tensor.clone() for name, tensor in iter_model_tensors_to_rank0(gpt)}
    layers = len(gpt.decoder.layers)
    converted = read_model_config(ckpt_dir)
    gpt = build_gpt_model(converted, transformer_config(converted, pipeline_parallel=2, first_stage_layers=FIRST_STAGE))
    load_model_checkpoint(gpt, ckpt_dir)
    logits = megatron_logits(gpt, _tokens(converted.vocab_size))
    if rank == 0:
        Path(resaved_dir).mkdir()
        write_model_config(resaved_dir, converted)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(resaved_dir))
    return {
        "layers": layers,
        "streamed": streamed,
        "logits": logits if ps.is_pipeline_last_stage() else None,
    }


def _convert_back(rank, world, ckpt_dir, hf_dir, hf_files):
    from megatron_zcpo.convert.checkpoint import convert_megatron_to_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    setup_megatron()
    convert_megatron_to_hf(ckpt_dir, hf_dir, max_shard_bytes=40_000, hf_files=hf_files)


def test_pp2_with_3_plus_2_layers_streams_and_converts_like_pp1(tmp_path):
    hf_dir, ckpt_dir, resaved = tmp_path / "hf", tmp_path / "megatron", tmp_path / "resaved_pp2_uneven"
    _make_hf_model(hf_dir, "qwen2", HF_FIVE_LAYERS, torch.float32, seed=0)
    weights, pp1_logits = run_distributed(_weights_and_convert_at_pp1, 1, str(hf_dir), str(ckpt_dir))[0]
    results = run_distributed(_uneven_rank, 2, FIVE_LAYERS, weights, str(ckpt_dir), str(resaved))
    assert [result["layers"] for result in results] == [3, 2]  # the stages really are uneven
    streamed = results[0]["streamed"]  # every layer once, under its global index, equal to what was loaded
    assert streamed.keys() == weights.keys()
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, weights[name], atol=0, rtol=0, msg=name)
    logits = results[1]["logits"]
    torch.testing.assert_close(logits, pp1_logits, atol=1e-6, rtol=0)
    assert (logits - _hf_logits(hf_dir, _tokens(HF_FIVE_LAYERS["vocab_size"]))).abs().max().item() < 1e-4
    # a trainer's checkpoint carries no hf/: the converted one's config.json goes with it
    run_distributed(_convert_back, 1, str(resaved), str(tmp_path / "hf_back"), str(ckpt_dir / "hf"))
    _assert_same_hf_checkpoint(hf_dir, tmp_path / "hf_back")
