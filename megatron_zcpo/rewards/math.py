"""DAPO correctness reward: a response's final answer (boxed, or DAPO's "Answer:" line) checked by math-verify."""

from __future__ import annotations

import logging
import re
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


# DAPO-Math-17K's prompts ask for a last line "Answer: $Answer"; the answer runs to the end of its line.
_ANSWER_LINE = re.compile(r"(?im)\banswer\s*:\s*(.+?)\s*$")
# A plain (optionally signed) integer, the whole answer of most arithmetic tasks.
_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")
_BOXED_INTEGER = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")


def _integer_verdict(response: str, ground_truth: str) -> Optional[bool]:
    """The verdict without math-verify when it cannot differ from math-verify's: the ground truth is
    a plain integer and the response's only ``\\boxed`` holds a plain integer. None otherwise."""
    gold = _INTEGER.fullmatch(ground_truth)
    if gold is None or response.count("\\boxed") != 1:
        return None
    answer = _BOXED_INTEGER.search(response)
    return None if answer is None else int(answer.group(1)) == int(gold.group(1))


def final_answer_text(response: str):
    """The text math-verify should read: the response itself when it has a ``\\boxed{}`` answer,
    else its last ``Answer: ...`` line boxed (``$`` delimiters dropped), else None."""
    if "\\boxed" in response:
        return response
    lines = _ANSWER_LINE.findall(response)
    answer = lines[-1].strip().strip("$").strip() if lines else ""
    return f"\\boxed{{{answer}}}" if answer else None


def math_answer_is_correct(response: str, ground_truth: str) -> bool:
    """Whether the final answer of ``response`` equals ``ground_truth`` mathematically.

    The final answer is the last ``\\boxed{...}``, or when there is none the last ``Answer: ...`` line
    (the format DAPO-Math-17K's prompts ask for). Equivalent forms count (``\\frac{1}{2}`` = ``0.5`` =
    ``1/2``, ``(x+1)^2`` = ``x^2+2x+1``); a response with neither, or whose answer does not parse, is
    wrong. Runs without math-verify's signal-based timeouts, so it is safe on any thread; bound its
    time from outside (:class:`megatron_zcpo.rewards.pool.RewardWorkerPool` kills a worker that overruns).
    """
    fast = _integer_verdict(response, ground_truth)
    if fast is not None:  # ~100x faster than parse + verify, same verdict on plain integers
        return fast
    return math_verify_verdict(response, ground_truth)


def math_verify_verdict(response: str, ground_truth: str) -> bool:
    """:func:`math_answer_is_correct` always through math-verify's parse and verify (no integer fast path)."""
    response = final_answer_text(response)
    if response is None:
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
    """DAPO's rule-based correctness reward: +1.0 if the final answer is correct, else -1.0.

    Follows the reward-function contract of :class:`megatron_zcpo.rewards.RewardConfig` (``function``):
    ``fn(response, ground_truth, metadata) -> float``; ``metadata`` (data source, uid, extra info) is unused.
    """
    return 1.0 if math_answer_is_correct(response, ground_truth) else -1.0
