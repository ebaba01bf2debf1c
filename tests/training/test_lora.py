"""LoRA adapters on megatron-core: every layout trains the same adapters, the base stays frozen, the reference
is the base, recompute keeps the adapters' gradients, resume is exact, pushes and exports equal HF PEFT's.

Two spawns: one process (the weights and every single-process case) and four (every layout, against it).
"""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import lora_cases

COMPARED = ("update/loss", "update/policy_loss", "update/grad_norm", "experience/kl", "coef/coef_abs_mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_distributed(lora_cases.single_process, 1, str(tmp_path_factory.mktemp("lora_ckpt")))[0]


LAYOUTS = {
    "TP2": dict(tp=2),
    "PP2-uneven-distopt": dict(pp=2, first_stage_layers=2, distopt=True, gradients=False),
    "CP2xTP2-SP": dict(cp=2, tp=2, sp=True),
}


@pytest.fixture(scope="module")
def layouts(single):
    base, adapters = single["weights"]
    moe_base, moe_adapters = single["moe_weights"]
    cases = [(name, "layout_step", dict(base=base, adapters=adapters, **layout)) for name, layout in LAYOUTS.items()]
    cases.append(("MoE-EP2", "layout_step", dict(base=moe_base, adapters=moe_adapters, model=lora_cases.MOE, ep=2)))
    tp2pp2 = dict(tp=2, pp=2, first_stage_layers=2)
    cases.append(("merged-push-TP2xPP2", "push_capture", dict(base=base, adapters=adapters, **tp2pp2)))
    cases.append(("resharded", "load_elsewhere", dict(base=base, checkpoint=single["resume"]["checkpoint"], **tp2pp2)))
    return run_distributed(lora_cases.run_cases, 4, cases)


def _same_step(result, reference, name):
    for metric in COMPARED:
        assert result["metrics"][metric] == pytest.approx(reference["metrics"][metric], rel=1e-5, abs=1e-6), (
            name,
            metric,
        )
    for key, value in reference["adapters"].items():
        torch.testing.assert_close(result["adapters"][key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
    for key, value in reference["merged"].items():
        torch.testing.assert_close(result["merged"][key], value, atol=1e-5, rtol=0, msg=f"{name}: merged {key}")
    if result["grads"] is not None:
        assert set(result["grads"]) == set(reference["grads"])
        for key, value in reference["grads"].items():
            torch.testing.assert_close(result["grads"][key], value, atol=1e-6, rtol=1e-4, msg=f"{name}: grad {key}")


@pytest.mark.parametrize("name", [*LAYOUTS, "MoE-EP2"])
def test_every_layout_trains_the_same_adapters_as_one_process(single, layouts, name):
    """TP2, uneven PP2 with the distributed optimizer, CP2 x TP2 + SP (the replicated adapter matrices'
    gradients reduced over TP), and EP2 for a mixture-of-experts model's attention adapters: the loss,
    the adapters' gradients (before any step), the step and the merged weights equal one process's."""
    reference = single["moe" if name == "MoE-EP2" else "tp1"]
    results = [rank[name] for rank in layouts]
    for result in results:
        _same_step(result, reference, name)
    assert max(float(g.abs().max()) for g in reference["grads"].values()) > 1e-4  # every case has gradients


def test_the_base_is_frozen_and_only_the_adapters_are_trained(single):
    tp1 = single["tp1"]
    assert tp1["frozen"]
    adapter_parameters = sum(t.numel() for t in tp1["adapters"].values())
    assert tp1["ddp_parameters"] == tp1["optimized_parameters"] == adapter_parameters  # no base grads or state
    assert set(tp1["grads"]) == set(tp1["adapters"])
    base, adapters = single["weights"]
    moved = max(float((tp1["adapters"][n] - adapters[n]).abs().max()) for n in adapters)
    assert moved > 1e-5
    merged_attention = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(tp1["merged"][merged_attention], base[merged_attention])  # the adapter reached the push
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(tp1["merged"][name], base[name])


def test_the_step_zero_kl_is_exactly_zero(single):
    """B = 0: the policy is the base to the bit, so the step-0 self-check and the KL read 0, not ~1e-7."""
    assert single["step_zero"] == {"selfcheck/kl_max": 0.0, "selfcheck/logprob_gap_max": 0.0, "experience/kl": 0.0}


def test_the_reference_pass_is_the_base_model(single):
    """The reference of a LoRA policy (adapters off, same modules) gives the base model's log-probs."""
    gaps, moved = [], []
    for policy, reference, base in single["reference"].values():
        gaps.append(float((reference - base).abs().max()))
        moved.append(float((policy - base).abs().max()))
    assert max(gaps) < 1e-6
    assert max(moved) > 1e-4  # the adapters are on in the policy's pass


def test_full_recompute_keeps_the_adapter_gradients(single):
    """With a frozen embedding the recomputed layers' input needs no grad: without the decoder's
    pre-hook their backward never runs and every adapter gradient is silently 0."""
    for name, grad in single["tp1"]["grads"].items():
        torch.testing.assert_close(single["recompute"][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_resume_is_exact_and_the_checkpoint_holds_only_the_adapters(single):
    resume = single["resume"]
    (straight, adapters), (again, resumed) = resume["straight"], resume["resumed"]
    for metric in COMPARED:
        assert again[metric] == straight[metric], metric
    for name, value in adapters.items():
        assert torch.equal(resumed[name], value), name
    stored = resume["stored"]
    assert stored and all("_lora.lora_" in key for key in stored), stored
    assert not any(key.startswith("embedding") for key in stored)


def test_the_adapters_load_at_another_layout(single, layouts):
    """A TP1 checkpoint's adapters at TP2 x PP2 (fc1's B resharded as SwiGLU's [gate; up], like fc1)."""
    for rank in layouts:
        for name, value in single["resume"]["saved"].items():
            assert torch.equal(rank["resharded"][name], value), name


def _hf_base(base):
    """transformers' model of the tiny LoRA architecture holding ``base`` (fp32)."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.rollout.embedded import build_hf_causal_lm

    model = build_hf_causal_lm(lora_cases.MODEL)
    missing, unexpected = model.load_state_dict(
        dict(megatron_to_hf_stream(base.items(), lora_cases.MODEL)), strict=False
    )
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: lm_head is the embedding
    return model


def _peft_folder(adapters, directory):
    from megatron_zcpo.convert.peft import megatron_adapters_to_peft_stream, peft_adapter_config, write_peft_adapter

    stream = megatron_adapters_to_peft_stream(adapters.items(), lora_cases.MODEL)
    return write_peft_adapter(directory, stream, peft_adapter_config(lora_cases.LORA, "tiny-base"))


def test_the_peft_export_loads_into_hf_peft_with_megatrons_logits(single, tmp_path):
    """The PEFT folder of the adapters, loaded by HF PEFT on the HF base, gives the LoRA policy's logits."""
    from peft import PeftModel

    base, adapters = single["weights"]
    _peft_folder(adapters, tmp_path)
    model = PeftModel.from_pretrained(_hf_base(base), str(tmp_path))
    with torch.no_grad():
        logits = model(torch.tensor([[3, 17, 42, 99, 5, 150, 7]])).logits[0].float()
    torch.testing.assert_close(logits, single["logits"], atol=2e-5, rtol=1e-5)
    without = _hf_base(base)(torch.tensor([[3, 17, 42, 99, 5, 150, 7]])).logits[0].float()
    assert float((without - logits).abs().max()) > 1e-3  # the adapter changes them: it was loaded


def test_the_merged_push_equals_peft_merge_to_the_serving_dtype(single, layouts, tmp_path):
    """W + (alpha/r) B A, merged per shard in fp32 at TP2 x PP2 and pushed through rank 0, equals what HF
    PEFT's merge_and_unload gives, in fp32 and once both are cast to bf16 (at most one bf16 step apart)."""
    from peft import PeftModel

    base, adapters = single["weights"]
    _peft_folder(adapters, tmp_path)
    merged = PeftModel.from_pretrained(_hf_base(base), str(tmp_path)).merge_and_unload().state_dict()
    pushed = layouts[0]["merged-push-TP2xPP2"]["received"]
    assert set(pushed) == set(merged) - {"lm_head.weight"}
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream

    hf_base = dict(megatron_to_hf_stream(base.items(), lora_cases.MODEL))
    adapted = {name for name in pushed if not torch.equal(pushed[name], hf_base[name])}
    assert {name.split(".")[-2] for name in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj"} | {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-6, msg=name)
        ours, theirs = tensor.to(torch.bfloat16).float(), merged[name].to(torch.bfloat16).float()
        step = torch.finfo(torch.bfloat16).eps * torch.maximum(ours.abs(), theirs.abs())
        assert bool(((ours - theirs).abs() <= step).all()), name
    assert all(layouts[rank]["merged-push-TP2xPP2"]["received"] == {} for rank in (1, 2, 3))


def test_the_adapter_push_sends_the_peft_adapter_alone(single, layouts, tmp_path):
    """push: adapter hands rank 0's engine the PEFT tensors and adapter_config.json: a few KiB here, where
    the merged push sends the whole model."""
    from safetensors.torch import load_file

    _, adapters = single["weights"]
    push = single["adapter_push"]
    _peft_folder(adapters, tmp_path)
    exported = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(push["received"]) == set(exported)
    for key, value in exported.items():
        torch.testing.assert_close(push["received"][key], value, atol=0, rtol=0, msg=key)
    config = push["config"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert push["bytes"] == sum(t.numel() * t.element_size() for t in exported.values())
    assert push["bytes"] * 5 < layouts[0]["merged-push-TP2xPP2"]["bytes"]


def test_a_lora_checkpoint_merges_into_its_base_and_exports_as_peft(single):
    """tools/convert_megatron_to_hf.py's library: the checkpoint's adapters merged into the Hugging Face
    base (W + (alpha/r) B A), and the PEFT folder of the same adapters."""
    from safetensors.torch import load_file

    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.convert.peft import megatron_adapters_to_peft_stream

    base, _ = single["weights"]
    saved = single["resume"]["saved"]  # the adapters the checkpoint holds
    exports = single["exports"]
    expected = dict(base)
    for name in [n for n in saved if n.endswith("lora_a")]:
        weight = name.replace("_lora.lora_a", ".weight")
        expected[weight] = base[weight] + 2.0 * saved[name.replace("lora_a", "lora_b")] @ saved[name]
    with SafetensorsCheckpoint(exports["merged"]) as merged:
        written = {name: merged.tensor(name) for name in merged.names()}
    hf_expected = dict(megatron_to_hf_stream(expected.items(), lora_cases.MODEL))
    assert set(written) == set(hf_expected)
    for name, tensor in hf_expected.items():
        torch.testing.assert_close(written[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    peft = load_file(f"{exports['peft']}/adapter_model.safetensors")
    expected_peft = dict(megatron_adapters_to_peft_stream(saved.items(), lora_cases.MODEL))
    assert set(peft) == set(expected_peft)
    for key, tensor in expected_peft.items():
        assert torch.equal(peft[key], tensor), key
