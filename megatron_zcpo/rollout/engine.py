"""The rollout-engine interface the trainer codes against: sampling parameters, completions, engines."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """How to sample responses (the fields of SGLang's ``sampling_params`` that RL needs).

    ``temperature`` 0 means greedy decoding. ``top_k`` <= 0 and ``top_p`` = 1 disable those
    filters. Generation of a response stops after a token in ``stop_token_ids`` (that token is
    part of the output) or after ``max_new_tokens`` tokens. ``seed`` makes sampling reproducible;
    None draws from the engine's own generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self):
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the offending field when a value is out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling.temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k:
            raise ValueError(f"sampling.top_k must be an integer, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled response to one prompt.

    ``output_logprobs[i]`` is log pi(output_ids[i] | prompt, output_ids[:i]) where pi is
    softmax(logits / temperature) over the FULL vocabulary (softmax(logits) when greedy). top-p
    and top-k only decide which tokens may be drawn; they are not renormalised into the
    log-prob, so it is what the trainer computes for the same policy at that temperature (and
    what SGLang returns by default). The truncated sampling distribution is pi / Z with
    Z = the kept mass <= 1, so its log-prob is ``output_logprobs[i] - log Z``.
    ``finish_reason``: "stop" (a stop token was produced, and is the last output token),
    "length" (max_new_tokens or the model's context was reached) or "abort" (the engine gave up
    on the request; the output may be empty). ``weight_version`` is the policy version that
    produced it (SGLang's served version; None when the engine does not report one).
    ``routed_experts`` (mixture-of-experts models, when asked for): the experts the engine routed
    every input token to (the prompt and the output but its last token), int32
    [len(prompt_ids) + len(output_ids) - 1, num_layers * top_k] as SGLang returns them (zeros in
    the slots of dense layers), else None.
    ``output_mask`` (multi-turn rollouts, :mod:`megatron_zcpo.rollout.multi_turn`): per output token
    1 where the policy produced it (trained) and 0 where a tool's turn was appended (its
    ``output_logprobs`` are placeholders 0.0); None: every output token is the policy's.
    ``output_versions`` (asynchronous rollouts, whose responses may continue across weight pushes):
    per output token the weight version that produced it (its ``output_logprobs`` entry is that
    version's); None: every token is ``weight_version``'s.
    """

    prompt_ids: List[int]
    output_ids: List[int]
    output_logprobs: List[float]
    finish_reason: str
    weight_version: Optional[int] = None
    info: dict = field(default_factory=dict)
    routed_experts: Optional[torch.Tensor] = None
    output_mask: Optional[List[int]] = None
    output_versions: Optional[List[int]] = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"Completion has {len(self.output_ids)} output_ids but {len(self.output_logprobs)} output_logprobs"
            )
        if self.output_mask is not None and len(self.output_mask) != len(self.output_ids):
            raise ValueError(
                f"Completion has {len(self.output_ids)} output_ids but {len(self.output_mask)} output_mask"
            )
        if self.output_versions is not None and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"Completion has {len(self.output_ids)} output_ids but {len(self.output_versions)} output_versions"
            )

    @property
    def policy_ids(self) -> List[int]:
        """The output tokens the policy produced (all of them without ``output_mask``)."""
        if self.output_mask is None:
            return list(self.output_ids)
        return [t for t, keep in zip(self.output_ids, self.output_mask) if keep]

    @property
    def token_versions(self) -> List[Optional[int]]:
        """The weight version of every output token (``weight_version`` for each without ``output_versions``)."""
        if self.output_versions is not None:
            return list(self.output_versions)
        return [self.weight_version] * len(self.output_ids)

    @property
    def truncated(self) -> bool:
        """Whether the response was cut at the length limit (for overlong filtering)."""
        return self.finish_reason == "length"


class RolloutError(RuntimeError):
    """A rollout engine could not serve a request (after retries) or refused a weight update."""


class RolloutInterrupted(Exception):
    """A :meth:`RolloutEngine.generate` call ended by :meth:`RolloutEngine.interrupt_generation` (a stop
    request during a step's rollout): it returns nothing, and its requests are ended on the engine. Not a
    :class:`RolloutError`: nothing failed, and no handler of engine failures (a rejected sample, a retry)
    may take it for one."""


# How often a rollout in progress looks for a stop request (the recipe's interruptible step).
STOP_POLL_S = 0.1


class RolloutEngine(abc.ABC):
    """What the trainer needs from an inference engine.

    Engines are context managers: ``with make_engine(...) as engine: ...`` shuts them down on
    exit, also when the body raises.
    """

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1, affinity=None
    ) -> List[List[Completion]]:
        """Sample ``n`` responses for each prompt (token ids); result[i][j] is prompt i's j-th sample.

        Synchronous for the caller; engines batch or run requests concurrently inside.
        ``affinity`` (optional, one int per prompt): requests with the same key should go to the same
        server where the engine has several (a multi-turn trajectory's turns share their prefix).
        """

    @abc.abstractmethod
    def update_weights(self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights, given as a stream of (Hugging Face name, tensor), as ``version``.

        The stream may cover a subset of the parameters (one pipeline stage's share); the engine
        serves ``version`` once the call returns.
        """

    @abc.abstractmethod
    def weight_version(self) -> int:
        """The policy version the engine currently serves (-1 before the first update)."""

    # Colocated placement (megatron_zcpo.rollout.placement): the engine hands its memory back between
    # rollouts. Regions are the tags of megatron_zcpo.rollout.memory ("weights", "kv_cache", "cuda_graph").

    def memory_tags(self) -> Tuple[str, ...]:
        """The memory regions this engine can release (none: it cannot be colocated)."""
        return ()

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free the memory of ``tags`` (None: every region) once no request runs; its content is lost."""
        raise RolloutError(f"{type(self).__name__} cannot release its memory (rollout.placement=colocated)")

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Allocate ``tags`` (None: every region) again; released weights must be pushed anew."""
        raise RolloutError(f"{type(self).__name__} cannot resume its memory (rollout.placement=colocated)")

    def pause_generation(self) -> None:
        """Hold generation (around a weight update); a no-op where nothing can generate meanwhile.
        Requests of :meth:`submit` in flight hold with the tokens they have."""
        return None

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`: held requests continue from their tokens with the weights
        pushed meanwhile."""
        return None

    # The interruptible step (a stop signal during a step's rollout): generation ends promptly.

    def interrupt_generation(self) -> None:
        """From any thread: the :meth:`generate` call in progress ends soon and raises
        :class:`RolloutInterrupted`, and so does every later call until :meth:`clear_interrupt`.
        Engines that cannot be interrupted (this default) finish their call."""
        return None

    def clear_interrupt(self) -> None:
        """Undo :meth:`interrupt_generation`: :meth:`generate` runs to the end again."""
        return None

    # Asynchronous rollouts (rollout.mode=async: megatron_zcpo.rollout.async_rollout).

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1):
        """Start sampling ``n`` responses to one prompt; returns a ``concurrent.futures.Future`` of its
        ``n`` Completions, resolved once the last has finished. A request in flight survives weight
        pushes between :meth:`pause_generation` and :meth:`continue_generation`: it continues from
        the tokens it has (never re-tokenised), each token's version in ``Completion.output_versions``
        and its log-prob the one it was drawn with."""
        raise RolloutError(f"{type(self).__name__} cannot run asynchronous rollouts (rollout.mode=async)")

    def abort_requests(self) -> int:
        """End every request of :meth:`submit` in flight: their futures resolve with the tokens they
        have (unfinished samples "abort"). Returns how many requests ended."""
        return 0

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the engine's resources (processes, sessions, memory); idempotent."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown()


def validate_prompts(prompts: Sequence[Sequence[int]], n: int, vocab_size: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the offending prompt (row) when a prompt is empty or out of vocabulary."""
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty")
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(f"prompt {row} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
