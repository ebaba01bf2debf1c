"""Evaluation over a prompt set: avg@k accuracy and unbiased pass@k with the rollout engine, results to JSON."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.rewards.scorer import RewardBatch


def pass_at_k(num_samples: torch.Tensor, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021).

    Computed in float64 through log-gamma, so large n does not overflow; exactly 1 when n - c < k.

    Args:
        num_samples: [P] samples drawn per problem (n; every n must be >= k).
        num_correct: [P] correct samples per problem (c).
    Returns:
        [P] float64 probabilities that at least one of k samples drawn without replacement is correct.
    """
    n = num_samples.to(torch.float64)
    c = num_correct.to(torch.float64)
    if k < 1 or bool((n < k).any()):
        raise ValueError(f"pass@{k} needs 1 <= k <= samples per problem; got samples {num_samples.tolist()}")
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError(
            f"num_correct must be in [0, num_samples]; got {num_correct.tolist()} of {num_samples.tolist()}"
        )
    wrong = n - c
    can_all_fail = wrong >= k  # otherwise every draw of k samples holds a correct one
    safe_wrong = torch.where(can_all_fail, wrong, torch.full_like(wrong, float(k)))
    log_ratio = (
        torch.lgamma(safe_wrong + 1) - torch.lgamma(safe_wrong - k + 1) - torch.lgamma(n + 1) + torch.lgamma(n - k + 1)
    )
    return torch.where(can_all_fail, 1.0 - torch.exp(log_ratio), torch.ones_like(n))


def _accuracy_metrics(num_correct: torch.Tensor, k: int, pass_ks: Sequence[int]) -> Dict[str, float]:
    """avg@k and pass@j (j in pass_ks) averaged over problems, from [P] correct counts out of k samples."""
    samples = torch.full_like(num_correct, k)
    metrics = {f"avg@{k}": float((num_correct.to(torch.float64) / k).mean())}
    metrics.update({f"pass@{j}": float(pass_at_k(samples, num_correct, j).mean()) for j in pass_ks})
    return metrics


def evaluate(
    engine,
    records: Sequence[PromptRecord],
    score: Callable[[Sequence[PromptRecord], List[List[Any]]], RewardBatch],
    sampling_params,
    k: int = 32,
    *,
    pass_ks: Optional[Sequence[int]] = None,
    batch_size: int = 64,
    output_path: Optional[str] = None,
) -> Dict[str, Any]:
    """Sample ``k`` responses per record with ``engine`` and report avg@k and pass@j accuracy.

    The paper's protocol is avg@32 at temperature 1.0, top-p 0.7. A sample is correct when its reward
    function score is > 0, it was scored (valid) and its reward call did not fail.

    Args:
        engine: a rollout engine (``generate(prompt_ids, params, n)``); records need ``prompt_ids``.
        score: ``score(records, completions) -> RewardBatch``, e.g.
            ``lambda r, c: scorer.score_completions(r, c, tokenizer)``.
        sampling_params: the engine's SamplingParams.
        pass_ks: the j of pass@j to report (default 1 and k); each must be <= k.
        batch_size: prompts per ``generate`` call.
        output_path: when given, the result is also written there as JSON.
    Returns:
        {"avg@k", "pass@j"..., "num_problems", "num_samples", "mean_response_length",
        "truncated_fraction", "failed_samples", "sampling", with multi-turn rollouts
        "tool_call_fraction" (samples that called a tool) and "tool_calls_mean", "by_source": {data_source: {avg@k, pass@j,
        num_problems}}, "problems": [{uid, data_source, num_correct, num_samples}]}.
    """
    if not records:
        raise ValueError("evaluate needs at least one record")
    missing_ids = [r.uid for r in records if not r.prompt_ids]
    if missing_ids:
        raise ValueError(f"records without prompt_ids (tokenize them first): {missing_ids[:5]}")
    pass_ks = sorted(set(pass_ks if pass_ks is not None else (1, k)))
    if k < 1 or any(not 1 <= j <= k for j in pass_ks):
        raise ValueError(f"need k >= 1 and every pass@j with 1 <= j <= k; got k={k}, pass_ks={pass_ks}")

    correct_counts, lengths, truncated, failed, tool_calls = [], [], [], 0, []
    for start in range(0, len(records), batch_size):
        batch_records = records[start : start + batch_size]
        completions = engine.generate([r.prompt_ids for r in batch_records], sampling_params, n=k)
        rewards = score(batch_records, completions)
        correct = (rewards.score > 0) & rewards.valid & ~rewards.failed
        correct_counts.append(correct.sum(dim=1))
        lengths.extend(len(c.policy_ids) for group in completions for c in group)
        tool_calls.extend(c.info["tool_calls"] for group in completions for c in group if "tool_calls" in c.info)
        truncated.append(rewards.truncated)
        failed += int(rewards.failed.sum())
    num_correct = torch.cat(correct_counts)

    by_source_rows = collections.defaultdict(list)
    for index, record in enumerate(records):
        by_source_rows[record.data_source].append(index)
    result: Dict[str, Any] = {
        "k": k,
        **_accuracy_metrics(num_correct, k, pass_ks),
        "num_problems": len(records),
        "num_samples": len(records) * k,
        "mean_response_length": sum(lengths) / len(lengths),
        "truncated_fraction": float(torch.cat(truncated).float().mean()),
        "failed_samples": failed,
        "sampling": dataclasses.asdict(sampling_params),
        "by_source": {
            source: {"num_problems": len(rows), **_accuracy_metrics(num_correct[rows], k, pass_ks)}
            for source, rows in sorted(by_source_rows.items())
        },
        "problems": [
            {"uid": r.uid, "data_source": r.data_source, "num_correct": int(c), "num_samples": k}
            for r, c in zip(records, num_correct.tolist())
        ],
    }
    if tool_calls:  # multi-turn rollouts: how often the policy called a tool
        result["tool_call_fraction"] = sum(count > 0 for count in tool_calls) / len(tool_calls)
        result["tool_calls_mean"] = sum(tool_calls) / len(tool_calls)
    if output_path:
        write_json_atomically(result, output_path)
    return result


def write_json_atomically(payload: Dict[str, Any], path: str) -> None:
    """Write ``payload`` as indented JSON to ``path`` through a temporary file, so readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.write("\n")
    os.replace(temporary, path)
