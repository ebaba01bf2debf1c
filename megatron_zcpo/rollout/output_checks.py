"""Checks of what an inference engine returned, before any of it reaches the trainer."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from megatron_zcpo.rollout.engine import Completion

# log_softmax can round a near-certain token's log-prob a little above 0; beyond this it is wrong.
POSITIVE_LOGPROB_TOLERANCE = 1e-4


def engine_output_problem(
    output_ids: Sequence[int], logprobs: Sequence[float], logprob_ids: Sequence[int], vocab_size: Optional[int]
) -> Optional[str]:
    """What is wrong with one response, naming the first bad position; None when it is sound.

    ``output_ids`` [T] the sampled tokens, ``logprobs`` / ``logprob_ids`` [T] the engine's
    per-token log-probs and the token each belongs to (SGLang's ``output_token_logprobs``),
    ``vocab_size`` the trainer's vocabulary (None: not checked). Checked: equal lengths, ids in
    ``[0, vocab_size)``, ids that agree with the log-probs' ids, finite log-probs <= 0.
    """
    if len(logprobs) != len(output_ids) or len(logprob_ids) != len(output_ids):
        return f"{len(logprobs)} log-probs for {len(output_ids)} tokens"
    for position, (token, logprob, logprob_token) in enumerate(zip(output_ids, logprobs, logprob_ids)):
        if vocab_size is not None and not 0 <= token < vocab_size:
            return f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
        if token != logprob_token:
            return f"output_ids has token {token} at position {position} but output_token_logprobs has {logprob_token}"
        if not math.isfinite(logprob) or logprob > POSITIVE_LOGPROB_TOLERANCE:
            return f"log-prob {logprob} of token {token} at position {position} is not a finite value <= 0"
    return None


def rejected_completion(prompt_ids: Sequence[int], message: str, info: Optional[dict] = None) -> Completion:
    """An empty "abort" completion carrying ``message`` in ``info["rejected"]``.

    Aborted responses are unscorable, so dynamic sampling drops the whole group: nothing the
    engine got wrong is trained on, and no group is trained incomplete.
    """
    return Completion(list(prompt_ids), [], [], "abort", info={**(info or {}), "rejected": message})


def rejected_messages(groups: Sequence[Sequence[Completion]]) -> List[str]:
    """The rejection messages of every rejected completion in ``groups`` (prompt-major order)."""
    return [c.info["rejected"] for group in groups for c in group if "rejected" in c.info]
