"""DAPO's overlong reward shaping: the soft length penalty and the loss mask of truncated responses."""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, scaled by ``penalty_factor``.

    With L_max = ``max_length`` (the hard cap on generated tokens) and L_cache = ``buffer_length``:
    penalty 0 for length <= L_max - L_cache; (L_max - L_cache - length) / L_cache inside the buffer
    (falling linearly from 0 to -1); -1 beyond L_max. The paper's setting is L_max = 20,480 and
    L_cache = 4,096, i.e. responses up to 16,384 tokens are free.

    Args:
        response_lengths: [...] generated tokens per response (any integer or float dtype).
    Returns:
        [...] float32 penalties in [-penalty_factor, 0].
    """
    if buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(f"buffer_length must be in (0, max_length={max_length}], got {buffer_length}")
    free_length = max_length - buffer_length
    excess = response_lengths.to(torch.float32) - free_length
    return -penalty_factor * (excess / buffer_length).clamp(min=0.0, max=1.0)


def overlong_loss_mask(truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: responses cut at the length limit are left out of the loss.

    Args:
        truncated: [...] bool, True where generation stopped at the length limit (finish reason "length").
    Returns:
        [...] bool, True where the response takes part in the loss.
    """
    if truncated.dtype != torch.bool:
        raise TypeError(f"truncated must be a bool tensor, got {truncated.dtype}")
    return ~truncated
