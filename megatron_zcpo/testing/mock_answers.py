"""What real SGLang answers, per release, where the mock server imitates it: bodies, messages and meta keys.

Read off real 0.5.3.post3 and 0.5.23 servers on a CPU (:mod:`megatron_zcpo.testing.real_sglang_server`;
``tests/rollout/sglang/real/test_doubles.py`` sends the same requests to both and compares, so the two
cannot drift apart). The mock server (:mod:`megatron_zcpo.testing.mock_server`) builds its answers here.

- ``/generate``'s answer: ``output_ids``, ``meta_info`` with the release's keys (:data:`META_KEYS`) and,
  when the server loaded its tokenizer, ``text``; ``finish_reason`` {type, length} when cut by
  ``max_new_tokens``, {type, matched} at a stop token, {type, message, status_code, err_type} when
  aborted. Releases before ``OUTPUT_IDS_WITHOUT_PROMPT_SINCE`` with their tokenizer put up to 5 prompt
  tokens in front of ``output_ids`` (:func:`served_output_ids`).
- Refusals: a body that does not validate is 400 ``{"object": "error", "message", "type", "param",
  "code"}`` (FastAPI's 422, turned 400 by SGLang); a request over the context length 400
  ``{"error": {"message"}}`` (0.5.3.post3 at prompt + max_new_tokens >= context, 0.5.23 at > context); an unknown
  ``sampling_params`` key 400 ``{"error": "<string>"}`` from 0.5.23's JSON contract, but 500
  "Internal Server Error" from 0.5.3.post3 (its SamplingParams raises a TypeError); ``sampling_seed``
  null is 400 on 0.5.3.post3 and the default seed on 0.5.23 (:func:`sampling_refusal`).
- ``/flush_cache``: 200, or 400 while requests run, with each release's text (:func:`flush_answer`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_zcpo.rollout.sglang.api import (
    OUTPUT_IDS_WITHOUT_PROMPT_SINCE,
    PINNED_RELEASE,
    SAMPLING_FIELDS,
    release_at_least,
)

DETOKENIZER_PROMPT_TOKENS = 5  # INIT_INCREMENTAL_DETOKENIZATION_OFFSET: the prompt tokens of the window
# meta_info of a /generate answer with return_logprob, per release (the keys the real servers send).
META_KEYS: Dict[str, Tuple[str, ...]] = {
    PINNED_RELEASE: (
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "input_token_logprobs",
        "output_token_logprobs",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
    ),
    "0.5.23": (
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "reasoning_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_versions",
        "cached_tokens_details",
        "dp_rank",
        "e2e_latency",
        "response_sent_to_client_ts",
    ),
}
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


def served_output_ids(release: str, prompt_ids: Sequence[int], output_ids: List[int], tokenizer: bool) -> List[int]:
    """``output_ids`` as release ``release`` sends them: behind up to 5 prompt tokens when it runs its
    detokenizer (``tokenizer``: launched without ``--skip-tokenizer-init``) and is older than 0.5.4.post3."""
    if tokenizer and not release_at_least(release, OUTPUT_IDS_WITHOUT_PROMPT_SINCE):
        return list(prompt_ids[-DETOKENIZER_PROMPT_TOKENS:]) + list(output_ids)
    return list(output_ids)


def finish_reason(kind: str, output_ids: Sequence[int]) -> Dict[str, Any]:
    """``meta_info.finish_reason`` of an answer that ended by ``kind`` ("length", "stop" or "abort")."""
    if kind == "length":
        return {"type": "length", "length": len(output_ids)}
    if kind == "stop":
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def version_spans(versions: Sequence[Any]) -> List[Dict[str, Any]]:
    """SGLang 0.5.23's ``weight_versions``: [{version, start, end}] over runs of equal per-token versions."""
    spans: List[Dict[str, Any]] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": str(version), "start": position, "end": position + 1})
    return spans


def generate_answer(
    release: str,
    *,
    logprobs_asked: bool,
    rid: str,
    prompt_ids: Sequence[int],
    output_ids: List[int],
    logprobs: Sequence[float],
    finish: str,
    weight_version: str,
    tokenizer: bool,
    output_versions: Optional[Sequence[Any]] = None,
) -> Dict[str, Any]:
    """One ``/generate`` answer of release ``release`` with :data:`META_KEYS` (the log-prob keys only when
    ``logprobs_asked``: the request's ``return_logprob``); ``output_versions``: each output token's weight
    version where a push came mid-request (else all are ``weight_version``)."""
    values = {
        "id": rid,
        "finish_reason": finish_reason(finish, output_ids),
        "prompt_tokens": len(prompt_ids),
        "weight_version": weight_version,
        "num_retractions": 0,
        "input_token_logprobs": [[None, prompt_ids[-1], None]] if release == PINNED_RELEASE else [],
        "output_token_logprobs": [[lp, token, None] for lp, token in zip(logprobs, output_ids)],
        "output_token_logprobs_length": len(output_ids),
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_versions": version_spans(
            [weight_version] * len(output_ids) if output_versions is None else output_versions
        ),
        "cached_tokens_details": None,
        "dp_rank": None,
        "e2e_latency": 0.0,
        "response_sent_to_client_ts": 0.0,
    }
    answer: Dict[str, Any] = {
        "output_ids": served_output_ids(release, prompt_ids, output_ids, tokenizer),
        "meta_info": {key: values[key] for key in META_KEYS[release] if logprobs_asked or "logprobs" not in key},
    }
    if tokenizer:  # the mock has no tokenizer: an empty text where SGLang sends the decoded one
        answer = {"text": "", **answer}
    return answer


def sampling_refusal(release: str, sampling: Dict[str, Any]) -> Optional[Tuple[int, Any]]:
    """(status, JSON body or text) release ``release`` answers a ``/generate`` whose ``sampling_params`` are
    ``sampling`` with before generating, or None: an unknown key, or a null ``sampling_seed`` on 0.5.3.post3."""
    unknown = [name for name in sampling if name not in SAMPLING_FIELDS]
    if unknown:
        if release == PINNED_RELEASE:
            return 500, "Internal Server Error"
        return 400, {
            "error": f"unknown field `{unknown[0]}`, expected one of {', '.join(f'`{n}`' for n in SAMPLING_FIELDS)}"
        }
    if "sampling_seed" in sampling and sampling["sampling_seed"] is None and release == PINNED_RELEASE:
        return 400, {"error": {"message": "sampling_seed should not be None"}}
    return None


def validation_error(reason: str) -> Dict[str, Any]:
    """The body of SGLang's 400 for a request body that does not validate (FastAPI's 422, as SGLang turns it)."""
    return {"object": "error", "message": reason, "type": "Bad Request", "param": None, "code": 400}


def context_error(message: str) -> Dict[str, Dict[str, str]]:
    """The body of SGLang's 400 for a request over the context length (no ``type`` or ``code``)."""
    return {"error": {"message": message}}


def flush_answer(release: str, running: bool) -> Tuple[int, str]:
    """(status, text) of ``/flush_cache``: 400 while requests run (0.5.23: "Flush cache failed.")."""
    if not running:
        return 200, _FLUSHED
    return 400, (_FLUSHED if release == PINNED_RELEASE else "Flush cache failed.\n")
