"""One /generate request as the SGLang client sends it and its answer as a Completion: sampling parameters and
seeds, the answer's checks, per-token weight versions, routed experts (see :mod:`megatron_zcpo.rollout.sglang.api`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_zcpo.rollout.engine import Completion, RolloutError, SamplingParams
from megatron_zcpo.rollout.output_checks import engine_output_problem, rejected_completion
from megatron_zcpo.rollout.sglang.api import SEED_LIMIT


def parse_weight_version(value: Any) -> int:
    """A served weight version as an int; SGLang's initial "default" (or anything non-numeric) is -1."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def token_versions(meta: Dict[str, Any], count: int, served: Optional[int]) -> Optional[List[int]]:
    """The weight version of each of an answer's ``count`` output tokens: from SGLang 0.5.23's
    ``meta_info.weight_versions`` spans when present, else ``served`` (its ``weight_version``) for
    all; None when neither is known."""
    spans = meta.get("weight_versions")
    if not spans:
        return None if served is None else [served] * count
    versions: List[Optional[int]] = [None] * count
    for span in spans:
        for position in range(int(span["start"]), min(int(span["end"]), count)):
            versions[position] = parse_weight_version(span["version"])
    if any(v is None for v in versions):
        raise RolloutError(f"weight_versions spans {spans} do not cover the {count} output tokens")
    return versions  # type: ignore[return-value]


def request_seed(seed: int, index: int) -> int:
    """The ``sampling_seed`` of request ``index`` of a call seeded ``seed``: ``seed + index`` wrapped into
    [0, 2**31) (SGLang 0.5.3.post3 packs seeds as int32; a larger one crashes its scheduler)."""
    return (int(seed) + index) % SEED_LIMIT


def sglang_sampling_params(params: SamplingParams, seed: Optional[int] = None) -> Dict[str, Any]:
    """SGLang's ``sampling_params`` for ``params`` (``seed`` becomes ``sampling_seed``)."""
    sampling = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if seed is not None:
        sampling["sampling_seed"] = int(seed)
    return sampling


def completion_from_sglang(
    prompt_ids: Sequence[int], response: Dict[str, Any], *, vocab_size: Optional[int] = None, server: str = "?"
) -> Completion:
    """A :class:`Completion` from one /generate answer of ``server``.

    Raises ``RolloutError`` on a malformed answer. An answer with wrong content (token ids
    outside ``[0, vocab_size)``, NaN or positive log-probs, ids that disagree with
    ``output_token_logprobs``) becomes a rejected completion (see
    :func:`megatron_zcpo.rollout.output_checks.rejected_completion`) whose message names the
    server, the request and the position.
    """
    try:
        meta = response["meta_info"]
        finish = meta["finish_reason"]
        aborted = (finish.get("type") if isinstance(finish, dict) else finish) == "abort"
        # a request aborted before its prefill answers without tokens (SGLang's "Abort before prefill")
        output_ids = [int(t) for t in ((response.get("output_ids") or []) if aborted else response["output_ids"])]
        entries = (meta.get("output_token_logprobs") or []) if aborted else meta["output_token_logprobs"]
        logprobs, logprob_ids = [float(entry[0]) for entry in entries], [int(entry[1]) for entry in entries]
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise RolloutError(
            f"malformed /generate response from {server} (bad or missing {err}): {str(response)[:300]}"
        ) from None
    info = {"rid": meta.get("id"), "cached_tokens": meta.get("cached_tokens"), "server": server}
    problem = engine_output_problem(output_ids, logprobs, logprob_ids, vocab_size)
    if problem is not None:
        return rejected_completion(prompt_ids, f"server {server}, request {meta.get('id')}: {problem}", info)
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in ("stop", "length", "abort"):
        raise RolloutError(f"/generate response {meta.get('id')} from {server}: unknown finish_reason {finish!r}")
    version = None if meta.get("weight_version") is None else parse_weight_version(meta["weight_version"])
    return Completion(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        weight_version=version,
        output_versions=token_versions(meta, len(output_ids), version) if meta.get("weight_versions") else None,
        info=info,
        routed_experts=None
        if meta.get("routed_experts") is None
        else decode_routed_experts(
            meta["routed_experts"], len(prompt_ids) + len(output_ids) - 1, f"{server}, request {meta.get('id')}"
        ),
    )


def decode_routed_experts(encoded: str, tokens: int, where: str = "?") -> torch.Tensor:
    """SGLang's ``meta_info.routed_experts`` (base64 of int32 [tokens, layers, top-k], the experts of
    every input token: prompt and output but the last) as int32 [tokens, layers * top-k].
    Raises ``RolloutError`` naming ``where`` when it does not hold ``tokens`` rows."""
    import base64

    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    if tokens <= 0 or flat.numel() % tokens:
        raise RolloutError(f"routed experts from {where}: {flat.numel()} ids do not split into {tokens} tokens")
    return flat.reshape(tokens, -1)


def encode_routed_experts(routed: torch.Tensor) -> str:
    """The inverse of :func:`decode_routed_experts`: base64 of the int32 bytes (as SGLang sends them)."""
    import base64

    return base64.b64encode(routed.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")
