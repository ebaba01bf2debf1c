"""Headroom policy (fits / tight / does not fit), the busiest expert rank, and colocated placement."""

import dataclasses
import json

import pytest

from megatron_zcpo.cli.main import main
from megatron_zcpo.cli.plan import load_plan_config
from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.planning.colocated import ENGINE_RUNTIME_FRACTION, ColocatedMemory
from megatron_zcpo.planning.memory_model import GIB, Hardware, Layout, Workload
from megatron_zcpo.planning.planner import plan_memory
from megatron_zcpo.planning.step_time import Cluster, StepLoad, all_to_all_s
from megatron_zcpo.recipe.layout_checks import _memory_problems
from tests.cli.test_examples import EXAMPLES

QWEN_EXAMPLE = str(EXAMPLES / "qwen2.5-32b-zcpo" / "config.yaml")
A3B_EXAMPLE = str(EXAMPLES / "qwen3-30b-a3b-zcpo" / "config.yaml")
QWEN25_32B = preset_model_config("Qwen2.5-32B")


def _plan(capacity_gib=None, margin=0.02):
    layout = Layout(tensor_parallel=8, data_parallel=4, recompute="full")
    plan = plan_memory(QWEN25_32B, layout, Workload(micro_batch_tokens=22528, max_sequence_length=22528))
    if capacity_gib is None:
        return plan
    return dataclasses.replace(plan, hardware=Hardware(gpu_memory_gib=capacity_gib, margin_fraction=margin))


def test_fits_leaves_the_margin_tight_eats_it_and_only_the_modelled_tensors_refuse():
    plan = _plan()
    total, reserve = plan.total_bytes / GIB, plan.components["overhead"] / GIB
    assert plan.verdict == "fits" and plan.fits
    # the total fits the GPU but not with the 2% margin beside it
    tight = _plan(capacity_gib=total + 0.5)
    assert tight.verdict == "tight" and not tight.fits and "under the" in tight.tight_reason()
    # the modelled tensors fit only by using the reserve
    eaten = _plan(capacity_gib=total - reserve / 2)
    assert eaten.verdict == "tight" and "of the" in eaten.tight_reason() and "reserve" in eaten.tight_reason()
    assert _plan(capacity_gib=total - reserve - 0.1).verdict == "does not fit"
    assert _plan(capacity_gib=total + 0.5, margin=0.0).verdict == "fits"
    assert tight.to_dict()["verdict"] == "tight" and tight.to_dict()["tight_reason"]


def test_the_start_up_check_refuses_only_what_surely_does_not_fit(caplog):
    """At 50 GiB per GPU the 32B example is tight (warned), at 45 GiB its tensors alone overflow (refused)."""
    config = load_plan_config(QWEN_EXAMPLE)
    assert _memory_problems(config, QWEN25_32B, 32, gpu_memory_gib=50.0) == []
    assert "memory is tight" in caplog.text
    assert _memory_problems(config, QWEN25_32B, 32, gpu_memory_gib=45.0)


def test_the_busiest_expert_rank_sets_memory_and_all_to_all(capsys):
    """The 30B-A3B example's former layout, EP8 on 16 GPUs: the busiest rank's 1.3x routed tokens add
    their activations; it is tight (0.2 GiB left besides the reserve): reported, not refused (exit 0).
    The shipped EP16 fits."""
    args = ["plan", A3B_EXAMPLE, "--gpus", "16", "--preset", "Qwen3-30B-A3B", "parallel.expert=8", "--json"]
    assert main([*args, "--expert-imbalance", "1.0"]) == 0
    balanced = json.loads(capsys.readouterr().out)["plan"]
    assert main(args) == 0
    busiest = json.loads(capsys.readouterr().out)
    assert busiest["plan"]["verdict"] == "tight" and "under the" in busiest["plan"]["tight_reason"]
    assert busiest["plan"]["components_gib"]["activations"] > balanced["components_gib"]["activations"] + 0.3
    assert busiest["plan"]["total_gib"] == pytest.approx(79.43, abs=0.01) and balanced["total_gib"] < 78.9
    assert main(["plan", A3B_EXAMPLE, "--gpus", "16", "--preset", "Qwen3-30B-A3B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["verdict"] == "fits"
    model = preset_model_config("Qwen3-30B-A3B")
    load = StepLoad(generated_sequences=64, trained_sequences=64, prompt_tokens=100, response_tokens=400)
    cluster = Cluster(train_gpus=16, rollout_gpus=8)
    one = all_to_all_s(model, load, cluster, 8, "full", imbalance=1.0)
    assert all_to_all_s(model, load, cluster, 8, "full", imbalance=1.3) == pytest.approx(1.3 * one)


def test_placement_is_validated_and_named():
    with pytest.raises(Exception, match="rollout.placement"):
        load_plan_config(QWEN_EXAMPLE, ["rollout.placement=shared"])


def test_plan_json_gives_the_chosen_modes_step_and_its_tokens_per_gpu(capsys):
    base = ["plan", QWEN_EXAMPLE, "--gpus", "32", "--preset", "Qwen2.5-32B", "--json"]
    assert main(base) == 0
    sequential = json.loads(capsys.readouterr().out)
    timing = sequential["step_time"]
    assert timing["predicted_s"] == timing["sequential_s"] and sequential["rollout_mode"] == "sequential"
    trained_tokens = 512 * 16 * (1024 + 10240)  # prompts x G x mean (prompt + response)
    assert sequential["tokens_per_s_per_gpu"] == pytest.approx(trained_tokens / (timing["predicted_s"] * 64))
    assert sequential["colocated_memory"] is None
    assert main([*base, "rollout.mode=overlap"]) == 0
    timing = json.loads(capsys.readouterr().out)["step_time"]
    assert timing["predicted_s"] == timing["overlapped_s"]
    # colocated: generation on the 32 training GPUs, offload/onload and the IPC push; the engine's 0.85
    # pool leaves no room for the trainer's reserve: tight, the key to lower named; 0.6 fits.
    colocate = ["rollout.placement=colocated", "rollout.sglang.client.weight_sync=tensor"]  # CUDA IPC, no NCCL
    assert main([*base, *colocate]) == 0
    colocated = json.loads(capsys.readouterr().out)
    timing = colocated["step_time"]
    assert colocated["rollout_mode"] == "colocated" and timing["predicted_s"] == timing["colocated_s"]
    assert timing["colocated_s"] == pytest.approx(
        timing["rollout_s"] + timing["train_s"] + timing["offload_s"] + timing["ipc_push_s"]
    )
    assert colocated["tokens_per_s_per_gpu"] == pytest.approx(trained_tokens / (timing["predicted_s"] * 32))
    memory = colocated["colocated_memory"]
    assert memory["verdict"] == "tight" and "rollout.sglang.launch.mem_fraction_static" in memory["problems"][0]
    lowered = [
        *base,
        *colocate,
        "rollout.sglang.launch.model_path=hf",
        "rollout.sglang.launch.tp_size=4",
    ]
    assert main([*lowered, "rollout.sglang.launch.mem_fraction_static=0.6"]) == 0
    assert json.loads(capsys.readouterr().out)["colocated_memory"]["verdict"] == "fits"


def test_colocated_generation_phase_by_hand():
    plan = _plan()
    memory = ColocatedMemory(plan=plan, mem_fraction=0.6, bucket_bytes=2**29)
    expected = (0.6 + ENGINE_RUNTIME_FRACTION) * plan.capacity_bytes + plan.components["overhead"] + 2**29
    assert memory.generation_bytes == pytest.approx(expected)
    edge = ColocatedMemory(plan=plan, mem_fraction=memory.largest_mem_fraction, bucket_bytes=2**29)
    assert edge.generation_bytes == pytest.approx(plan.capacity_bytes - plan.margin_bytes)
    assert memory.verdict == "fits" and not memory.problems()
