"""DAPO correctness reward: the last \\boxed{} answer of a response checked against the ground truth by math-verify."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from math_verify import LatexExtractionConfig, parse, verify

# math-verify guards parse/verify with signal.alarm, which only works on a process's main thread. The
# reward worker pool enforces its own per-call timeout by killing the worker process instead, so the
# signal timeouts are switched off (None) here; math-verify logs a one-time warning about that.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# Only \boxed{} answers count (boxed matching gets the highest priority); "first_match" makes the last
# boxed answer decisive instead of falling back to other LaTeX in the response when it does not parse.
_RESPONSE_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
# Ground truths are bare answers ("34", "\\frac{1}{2}", "(1, 2)"): boxing them gives math-verify's LaTeX
# parser an unambiguous span.
_GROUND_TRUTH_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0)]


def math_answer_is_correct(response: str, ground_truth: str) -> bool:
    """Whether the last ``\\boxed{...}`` answer of ``response`` equals ``ground_truth`` mathematically.

    Equivalent forms count (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``(x+1)^2`` = ``x^2+2x+1``); a response
    without a ``\\boxed{}`` answer, or whose boxed answer does not parse, is wrong. Runs without
    math-verify's signal-based timeouts, so it is safe on any thread; bound its time from outside
    (:class:`megatron_zcpo.rewards.pool.RewardWorkerPool` kills a worker that overruns).
    """
    if "\\boxed" not in response:
        return False
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=_GROUND_TRUTH_EXTRACTION, parsing_timeout=None)
    if not gold:
        raise ValueError(f"ground truth {ground_truth!r} cannot be parsed by math-verify")
    answer = parse(
        response,
        extraction_config=_RESPONSE_EXTRACTION,
        extraction_mode="first_match",
        fallback_mode="no_fallback",
        parsing_timeout=None,
    )
    return bool(answer) and verify(gold, answer, timeout_seconds=None)


def dapo_math_reward(response: str, ground_truth: str, metadata: Optional[Mapping[str, Any]] = None) -> float:
    """DAPO's rule-based correctness reward: +1.0 if the boxed answer is correct, else -1.0.

    Follows the reward-function contract of :class:`megatron_zcpo.rewards.RewardConfig` (``function``):
    ``fn(response, ground_truth, metadata) -> float``; ``metadata`` (data source, uid, extra info) is unused.
    """
    return 1.0 if math_answer_is_correct(response, ground_truth) else -1.0
