"""FP8 (E4M3, per-tensor) rollout weights with nvidia-modelopt, in the layout SGLang's modelopt_fp8 loads.

Quantised rollouts are off by default. With them on, every pushed decoder linear weight becomes
``{name}`` in float8_e4m3fn plus ``{name}_scale`` (fp32 scalar, amax / 448): modelopt's FP8
per-tensor format, which SGLang serves with ``--quantization modelopt_fp8``. Embeddings, norms,
biases and the output layer stay in full precision (modelopt's default FP8 recipe excludes
``lm_head``). The rollout policy then differs from the trained one by the rounding, so the
trainer must run with its importance-sampling correction on (rollout log-probs vs. its own).
Activation scales (``input_scale``) come from the server's initial, calibrated checkpoint.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Tuple

import torch

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_fp8_quantized(hf_name: str) -> bool:
    """Whether the quantised rollout stores this Hugging Face tensor in FP8 (decoder linear weights)."""
    parts = hf_name.split(".")
    return len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS and ".layers." in hf_name


def quantize_fp8_per_tensor(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """modelopt's FP8 E4M3 per-tensor quantisation of ``weight`` [out, in].

    Returns (fp8 weight of the same shape, fp32 scalar scale = amax / 448); ``fp8 * scale``
    reconstructs it. An all-zero weight gets scale 1 (modelopt's fake quantiser guards it the
    same way).
    """
    from modelopt.torch.quantization.qtensor import FP8QTensor

    weight = weight.float()
    amax = weight.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    quantized, scale = FP8QTensor.quantize(weight, scales=scale)
    return quantized._quantized_data, scale.float()


def quantize_fp8_hf_weights(named_hf_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weight stream as an FP8 server loads it: each quantised ``name`` becomes ``name``
    (float8_e4m3fn) followed by ``name_scale`` (fp32 scalar); other tensors pass unchanged."""
    for name, tensor in named_hf_tensors:
        if is_fp8_quantized(name):
            quantized, scale = quantize_fp8_per_tensor(tensor)
            yield name, quantized
            yield name + "_scale", scale
        else:
            yield name, tensor


def fake_quantize_fp8_hf_weights(
    named_hf_tensors: Iterable[Tuple[str, torch.Tensor]],
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weight stream rounded through FP8 and back (same names, shapes and dtypes): what a
    full-precision engine must hold to compute like the FP8 server's weights."""
    for name, tensor in named_hf_tensors:
        if is_fp8_quantized(name):
            quantized, scale = quantize_fp8_per_tensor(tensor)
            tensor = (quantized.float() * scale).to(tensor.dtype)
        yield name, tensor
