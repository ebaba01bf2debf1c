"""model.lora at start-up (keys named), its checkpoints' records and resume checks, the planner's LoRA memory
and step time, the demo's LoRA arm: no process group needed."""

import dataclasses

import pytest

from megatron_zcpo.checkpoint.lora_base import (
    LoraCheckpointMismatchError,
    base_fingerprint,
    check_lora_resume,
    lora_record,
)
from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.megatron.lora import LoraConfig
from megatron_zcpo.recipe.config import build_run_config
from megatron_zcpo.utils.config_loader import ConfigError


def _config(tmp_path, **sections):
    data = {"model": {"architecture": {"vocab_size": 64}, "tokenizer": str(tmp_path)}, **sections}
    return build_run_config(data)


@pytest.mark.parametrize(
    "lora,message",
    [
        ({"rank": 0}, "model.lora.rank must be >= 1"),
        ({"alpha": -1}, "model.lora.alpha must be > 0"),
        ({"targets": ["linear_qkv", "experts"]}, r"model.lora.targets \['experts'\]"),
        ({"targets": []}, "model.lora.targets is empty"),
        ({"dropout": 1.0}, r"model.lora.dropout must be in \[0, 1\)"),
        ({"init": "zeros"}, "model.lora.init='zeros'"),
        ({"push": "lazy"}, "model.lora.push='lazy'"),
        ({"ranks": 8}, "unknown config key 'model.lora.ranks'"),
    ],
)
def test_bad_lora_keys_are_refused_at_start_up_naming_the_key(tmp_path, lora, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, model={"architecture": {"vocab_size": 64}, "tokenizer": str(tmp_path), "lora": lora})


def test_lora_runs_refuse_a_reference_and_an_adapter_push_without_sglang(tmp_path):
    model = {"path": str(tmp_path), "lora": {"rank": 8}}
    with pytest.raises(ConfigError, match="model.reference=.* with model.lora"):
        _config(tmp_path, model={**model, "reference": str(tmp_path)})
    adapter = {**model, "lora": {"rank": 8, "push": "adapter"}}
    with pytest.raises(ConfigError, match="model.lora.push=adapter .* needs rollout.engine=sglang"):
        _config(tmp_path, model=adapter)
    sglang = {"engine": "sglang", "sglang": {"server_urls": ["http://s:1"]}}
    with pytest.raises(ConfigError, match="set rollout.sglang.client.weight_dir"):
        _config(tmp_path, model=adapter, rollout=sglang)
    sglang["sglang"]["client"] = {"weight_dir": str(tmp_path)}
    assert _config(tmp_path, model=adapter, rollout=sglang).model.lora.push == "adapter"


def test_the_base_fingerprint_changes_with_the_weights_not_with_their_location(tmp_path):
    first, copy, other = (tmp_path / name for name in ("a", "b", "c"))
    for directory, byte in ((first, 1), (copy, 1), (other, 2)):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        blob = bytearray(9 * 2**20)  # sampled, not read whole
        blob[5 * 2**20 + 123] = byte
        (directory / "model.safetensors").write_bytes(bytes(blob))
        (directory / "tokenizer.json").write_text(str(byte))  # not a weight: not fingerprinted
    assert base_fingerprint(first) == base_fingerprint(copy) != base_fingerprint(other)
    with pytest.raises(FileNotFoundError, match="no weight files"):
        base_fingerprint(tmp_path / "missing")


def test_a_resume_is_refused_into_other_adapters_another_base_or_the_other_kind_of_run():
    lora = LoraConfig(rank=8)
    base = {"path": "/m/a", "fingerprint": "f" * 64}
    record = lora_record(lora, base)
    check_lora_resume(record, dataclasses.replace(lora, dropout=0.1, push="adapter"), base, "ckpt")  # free to change
    check_lora_resume(None, None, None, "ckpt")
    with pytest.raises(LoraCheckpointMismatchError, match="model.lora.rank: checkpoint 8 vs run 16"):
        check_lora_resume(record, LoraConfig(rank=16), base, "ckpt")
    with pytest.raises(LoraCheckpointMismatchError, match="trained its adapters on /m/a"):
        check_lora_resume(record, lora, {"path": "/m/b", "fingerprint": "e" * 64}, "ckpt")
    with pytest.raises(LoraCheckpointMismatchError, match="holds LoRA adapters only"):
        check_lora_resume(record, None, base, "ckpt")
    with pytest.raises(LoraCheckpointMismatchError, match="holds a whole fine-tuned model"):
        check_lora_resume(None, lora, base, "ckpt")


def test_the_planner_books_no_reference_and_no_base_gradients_for_lora():
    """Qwen2.5-72B at TP8: the frozen base's bf16 weights and the adapters' training state, no reference,
    the same activations; training skips the base's weight gradients (one forward-equivalent less)."""
    from megatron_zcpo.planning.lora_costs import lora_parameters
    from megatron_zcpo.planning.memory_model import GIB, Layout, Workload, stage_parameters
    from megatron_zcpo.planning.planner import plan_memory
    from megatron_zcpo.planning.step_time import Cluster, StepLoad, predict_step_time

    model = preset_model_config("Qwen2.5-72B")
    layout = Layout(tensor_parallel=8, recompute="full")
    full = Workload(micro_batch_tokens=8192, max_sequence_length=8192)
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    lora = dataclasses.replace(full, reference="adapters_off", lora_rank=32, lora_targets=targets)
    full_plan, lora_plan = plan_memory(model, layout, full), plan_memory(model, layout, lora)
    params = stage_parameters(model, layout, "first")
    # per layer, r = 32: replicated qkv A [r, h], proj B [h, r], fc1 A [r, h], fc2 B [h, r]; split over TP8
    # qkv B [q + 2 kv, r] (q 8192, kv 1024), proj A [r, q], fc1 B [2f, r], fc2 A [r, f] (f 29568)
    adapters = model.num_layers * (32 * 4 * 8192 + 32 * (8192 + 2048 + 8192 + 2 * 29568 + 29568) / 8)
    assert lora_plan.components["reference_model"] == 0 < full_plan.components["reference_model"]
    assert lora_plan.components["parameters"] == pytest.approx(2 * (params + adapters))
    assert lora_plan.components["gradients"] == pytest.approx(4 * adapters)
    assert lora_plan.components["optimizer_states"] == pytest.approx(12 * adapters)
    assert lora_plan.components["activations"] == full_plan.components["activations"]
    assert lora_plan.components["logits_kl"] == full_plan.components["logits_kl"]  # the reference pass still runs
    assert full_plan.total_bytes - lora_plan.total_bytes > 150 * GIB  # 72B: grads + Adam + reference, per 8 GPUs
    assert lora_parameters(model, 32, targets) == pytest.approx(358.2e6, rel=1e-3)
    load, cluster = StepLoad(512, 512, 1000, 4000), Cluster(train_gpus=8, rollout_gpus=8)
    trained = predict_step_time(model, load, cluster, recompute="full")
    frozen = predict_step_time(model, load, cluster, recompute="full", frozen_base=True, adapter_push_bytes=7e8)
    assert frozen.train_s / trained.train_s == pytest.approx(5 / 6)  # 2 experience + 1 + 1 + 1 recompute vs 6
    assert frozen.push_per_stage_s < trained.push_per_stage_s


def test_the_demo_has_a_lora_arm_and_flag():
    from megatron_zcpo.cli.demo_arms import LORA_ARM, parse_arms

    [zcpo, lora] = parse_arms(f"zcpo,{LORA_ARM}:model.lora.rank=8")
    config = lora.config({"model": {"path": "/m"}, "train": {"optimizer": {"lr": 2.5e-4}}})
    assert config["model"] == {"path": "/m", "lora": {"rank": 8, "alpha": 32.0}}
    assert config["train"]["optimizer"]["lr"] == 2.0e-3 and zcpo.name == "zcpo"
