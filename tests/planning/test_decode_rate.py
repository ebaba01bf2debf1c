"""The decode-rate roofline: its terms by hand, its calibration on SGLang's published figures, and
how it moves with response length and server memory."""

import pytest

from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.decode_rate import (
    LLAMA31_70B,
    SGLANG_V030_LLAMA31_70B_SHAREGPT,
    calibrated_efficiency,
    decode_roofline,
    decode_step_s,
    decode_tokens_per_s_per_gpu,
    kv_bytes_per_token,
)
from megatron_zcpo.planning.flops import forward_flops_per_token

QWEN25_32B = preset_model_config("Qwen2.5-32B")


def test_the_measured_model_is_the_llama_preset_architecture():
    preset = preset_model_config("Llama-3.3-70B")
    assert LLAMA31_70B.num_parameters == preset.num_parameters == 70_553_706_496
    assert kv_bytes_per_token(LLAMA31_70B) == kv_bytes_per_token(preset) == 2 * 80 * 8 * 128 * 2
    assert forward_flops_per_token(LLAMA31_70B, 1000) == forward_flops_per_token(preset, 1000)


def test_the_cited_throughput_is_reproduced_within_one_percent():
    """SGLang v0.3.0, Llama 3.1 70B on 4x H100 (mem-frac 0.88), offline ShareGPT: 3,856.01 tokens/s."""
    measured = SGLANG_V030_LLAMA31_70B_SHAREGPT
    assert measured.response_tokens == pytest.approx(194.36, abs=0.01)  # 3,856.01 / 19.84
    assert measured.prompt_tokens == pytest.approx(223.97, abs=0.01)  # 369,103 / 1,648
    per_gpu = decode_tokens_per_s_per_gpu(preset_model_config("Llama-3.3-70B"), 223.97, 194.36, 4, mem_fraction=0.88)
    assert 4 * per_gpu == pytest.approx(3856.01, rel=0.01)
    assert 0.2 < calibrated_efficiency() < 0.4


def test_roofline_terms_by_hand():
    model = ModelConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    weights = 2 * model.num_parameters
    kv_per_token = 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(model) == kv_per_token
    memory = 4 * weights  # two GPUs at mem_fraction 0.5 leave 3 x weights to the KV cache
    roofline = decode_roofline(
        model, 100, 300, 2, mem_fraction=0.5, gpu_memory_bytes=memory, hbm_bytes_per_s=1e6, peak_flops=1e9
    )
    batch = 3 * weights / (kv_per_token * 400)
    assert roofline.batch == pytest.approx(batch)
    memory_s = (weights + batch * kv_per_token * 250) / 2e6
    dense = model.num_parameters - 1000 * 64
    compute_s = batch * (2 * dense + 4 * 2 * 4 * 16 * 250) / 2e9
    assert memory_s > compute_s and roofline.step_s == pytest.approx(memory_s)
    prefill_s = batch / 300 * 100 * (2 * dense + 4 * 2 * 4 * 16 * 100 / 2) / 2e9
    assert roofline.prefill_s == pytest.approx(prefill_s)
    assert roofline.tokens_per_s_per_gpu == pytest.approx(batch / (2 * (memory_s + prefill_s)))
    # compute-bound when FLOPs are scarce: the step is the FLOPs term
    slow = decode_step_s(model, batch, 250, 2, hbm_bytes_per_s=1e6, peak_flops=1e3)
    assert slow == pytest.approx(batch * (2 * dense + 4 * 2 * 4 * 16 * 250) / 2e3)


def test_rate_falls_with_longer_responses_and_rises_with_server_memory():
    rates = [decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, response, 4) for response in (2048, 10240, 20480)]
    assert rates[0] > rates[1] > rates[2]
    tp4, tp8 = (decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, tp) for tp in (4, 8))
    assert tp8 > tp4  # the weights' share of each GPU halves: more KV cache per GPU, a larger batch
    assert decode_tokens_per_s_per_gpu(QWEN25_32B, 1024, 10240, 4, mem_fraction=0.9) > tp4
    with pytest.raises(ValueError, match="no KV cache left"):
        decode_tokens_per_s_per_gpu(LLAMA31_70B, 1024, 10240, 1)


@pytest.mark.parametrize("requests_per_s,median_e2e_s,median_tpot_s", [(4, 3.00524, 0.02503), (8, 4.06498, 0.03307)])
def test_published_online_tpot_is_faster_than_modelled_by_less_than_1_5x(requests_per_s, median_e2e_s, median_tpot_s):
    """SGLang's online figures on the same servers (benchmark/benchmark_vllm_060/README.md): the
    calibrated roofline's decode step at the in-flight batch (Little's law) is slower than the
    measured TPOT, by less than 1.5x: the modelled rate errs low, not high."""
    measured = SGLANG_V030_LLAMA31_70B_SHAREGPT
    in_flight = requests_per_s * median_e2e_s
    context = measured.prompt_tokens + measured.response_tokens / 2
    step = decode_step_s(LLAMA31_70B, in_flight, context, 4) / calibrated_efficiency()
    assert median_tpot_s < step < 1.5 * median_tpot_s
