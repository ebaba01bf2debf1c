"""Blockwise-FP8 Hugging Face checkpoints (DeepSeek-V3/R1 as released) read as bf16, one tensor at a time.

DeepSeek's checkpoints store most linear weights as ``float8_e4m3fn`` with one float32 scale per
block of ``weight_block_size`` (128 x 128) in ``<name>_scale_inv`` ([ceil(rows / 128), ceil(cols /
128)], the last blocks ragged); ``config.json`` says so in ``quantization_config`` (``quant_method``
"fp8", ``fmt`` "e4m3"). The weight is the element-wise product, computed in float32 and rounded to
bf16 once, as DeepSeek's own ``fp8_cast_bf16.py`` does (``weight_dequant``: ``x.float() * s``,
stored in the default bf16). Norms, the router, its correction bias and the embeddings are not
quantised and pass through as stored. A converted checkpoint holds the bf16 weights (the policy
trains in bf16) and its ``hf/config.json`` no longer has ``quantization_config``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def block_size_of(config: dict) -> Optional[Tuple[int, int]]:
    """The (rows, columns) block of a blockwise-FP8 ``config.json``, None when not quantised. Raises
    ``ValueError`` naming ``quantization_config`` for another quantisation (it would not convert)."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2 or quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"config.json quantization_config={quantization}: only blockwise e4m3 FP8 "
            f"(quant_method 'fp8' with weight_block_size, DeepSeek-V3's) is dequantised on conversion"
        )
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """bf16 ``weight`` [R, C] (float8) x ``scale_inv`` [ceil(R / block_r), ceil(C / block_c)] (float32,
    one per block), multiplied in float32. Raises ``ValueError`` when the scales do not tile the weight."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scales of shape {tuple(scale_inv.shape)} do not tile a {rows} x {cols} weight in "
            f"{block[0]} x {block[1]} blocks (expected {expected})"
        )
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scales).to(torch.bfloat16)


class DequantizedCheckpoint:
    """A :class:`~megatron_zcpo.convert.hf_checkpoint.SafetensorsCheckpoint` of a blockwise-FP8 model
    seen as bf16: :meth:`names` without the scales, :meth:`tensor` / :meth:`meta` of an FP8 weight
    its bf16 value / shape. Raises ``KeyError`` naming an FP8 weight whose scales are missing."""

    def __init__(self, source, block: Tuple[int, int]):
        self.source, self.block = source, block

    def names(self) -> List[str]:
        return [name for name in self.source.names() if not name.endswith(SCALE_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self.source and not name.endswith(SCALE_SUFFIX)

    def _scale_name(self, name: str) -> str:
        scale = name + SCALE_SUFFIX
        if scale not in self.source:
            raise KeyError(f"FP8 tensor {name!r} has no {scale!r} in the checkpoint {self.source.directory}")
        return scale

    def tensor(self, name: str) -> torch.Tensor:
        weight = self.source.tensor(name)
        if weight.dtype not in FP8_DTYPES:
            return weight
        return dequantize(weight, self.source.tensor(self._scale_name(name)), self.block)

    def meta(self, name: str) -> torch.Tensor:
        stored = self.source.meta(name)
        if stored.dtype not in FP8_DTYPES:
            return stored
        self._scale_name(name)
        return torch.empty(stored.shape, dtype=torch.bfloat16, device="meta")

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> DequantizedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_hf_weights(hf_dir, config: dict):
    """The weights of a Hugging Face directory one tensor at a time: its safetensors as stored, or as
    bf16 when ``config`` (its config.json) is blockwise FP8. Use as a context manager."""
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

    source = SafetensorsCheckpoint(hf_dir)
    block = block_size_of(config)
    return source if block is None else DequantizedCheckpoint(source, block)


def dequantized_config(config: dict) -> dict:
    """``config`` as its dequantised weights are (blockwise FP8: no ``quantization_config``, dtype bf16)."""
    if block_size_of(config) is None:
        return config
    config = {key: value for key, value in config.items() if key != "quantization_config"}
    config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
    return config
