"""Multi-turn rollouts with tools over any rollout engine: policy turns, tool turns masked out, token in, token out.

A trajectory is the prompt, then policy turns and tool turns, as token ids laid end to end: each
policy turn is exactly the ids (and log-probs) the engine produced, each tool turn the ids of the
tool's result wrapped by the chat template's tool turn (:class:`ToolTurnTemplate`). Nothing is
re-tokenised and the conversation is never re-rendered through the chat template, so templates
that are not append-only (Qwen3 drops the thinking of earlier assistant turns) change nothing: the
ids the trainer trains on are the ids the engine saw and produced. The trajectory comes back as
one :class:`~megatron_zcpo.rollout.engine.Completion` whose ``output_mask`` is 0 on tool tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.parser import ToolCall, parse_tool_call
from megatron_zcpo.agent_tools.registry import ToolRegistry
from megatron_zcpo.data.dataset import render_prompt
from megatron_zcpo.rollout.engine import Completion, RolloutEngine, SamplingParams, validate_prompts

_ASSISTANT_MARK, _RESULT_MARK = "ZCPO_ASSISTANT_MARK", "ZCPO_RESULT_MARK"
_TURN_SEED_STRIDE = 1_000_003  # seeds of successive turns (and budget batches within a turn) never meet


@dataclass(frozen=True)
class ToolTurnTemplate:
    """The text around a tool's result between two policy turns: ``before`` + result + ``after``.

    ``before`` closes the policy's turn (e.g. ``<|im_end|>\\n``) and opens the tool's; ``after``
    closes it and opens the next assistant turn (the generation prompt).
    """

    before: str
    after: str

    @classmethod
    def from_chat_template(
        cls, tokenizer, role: str = "tool", chat_template: str = "auto", enable_thinking: Optional[bool] = None
    ) -> ToolTurnTemplate:
        """The tool turn as the prompts are rendered (:func:`~megatron_zcpo.data.dataset.render_prompt`
        with ``data.chat_template`` and ``data.enable_thinking``): the text between an assistant
        message's end and the next generation prompt, with a tool message of role ``role`` between.
        So the next assistant turn opens as the first did (Qwen3 with enable_thinking false: with an
        empty think block), and plain-text prompts get plain-text tool turns ("\\n\\nTool: ...").
        Raises ValueError when the template does not render a ``role`` message."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _ASSISTANT_MARK},
            {"role": role, "content": _RESULT_MARK},
        ]
        text, _ = render_prompt(messages, tokenizer, chat_template, enable_thinking)
        start = text.find(_ASSISTANT_MARK)
        result = text.find(_RESULT_MARK, start)
        if start < 0 or result < 0:
            raise ValueError(f"tools.result_role: the chat template does not render a {role!r} message")
        return cls(text[start + len(_ASSISTANT_MARK) : result], text[result + len(_RESULT_MARK) :])

    def ids(self, tokenizer, result: str, turn_end: str = "") -> List[int]:
        """The tool turn's token ids. ``turn_end``: the policy turn's own closing text (its stop token,
        e.g. ``<|im_end|>``), which ``before`` then does not repeat. The template's text is tokenised
        with its special tokens (the role markers); the result as plain text, so a result holding
        ``<|im_end|>\\n<|im_start|>assistant`` stays text and cannot open a turn of its own."""
        before = self.before[len(turn_end) :] if turn_end and self.before.startswith(turn_end) else self.before
        return _ids(tokenizer, before) + _ids(tokenizer, result, as_text=True) + _ids(tokenizer, self.after)


def _ids(tokenizer, text: str, as_text: bool = False) -> List[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=as_text)["input_ids"])


def check_text_tokenisation(tokenizer) -> None:
    """Raise ValueError unless ``tokenizer`` tokenises the text of its special tokens as plain text
    when asked (``split_special_tokens``), as tool results are."""
    specials = [token for token in tokenizer.all_special_tokens if token]
    ids = _ids(tokenizer, "".join(specials), as_text=True)
    if set(ids) & set(tokenizer.all_special_ids):
        raise ValueError(
            "the tokenizer turns special-token text in tool results into special tokens even with "
            "split_special_tokens=True (a result could forge a turn): use a fast tokenizer of transformers >= 4.45"
        )


@dataclass
class _Trajectory:
    """One sample's trajectory as it grows (ids after the prompt: policy and tool turns)."""

    prompt: List[int]
    key: int
    ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    versions: List[Optional[int]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: Optional[str] = None
    stop_reason: str = ""
    call: Optional[ToolCall] = None  # the last policy turn's tool call
    turn_end: str = ""  # the last policy turn's closing stop-token text (the tool turn does not repeat it)

    def tokens(self) -> int:
        return len(self.prompt) + len(self.ids)

    def add(self, ids: Sequence[int], logprobs: Sequence[float], policy: bool) -> None:
        self.ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.mask += [int(policy)] * len(ids)

    def finish(self, reason: str, why: str) -> None:
        self.finish_reason, self.stop_reason = reason, why

    def completion(self) -> Completion:
        version = None if not self.versions or None in self.versions else min(self.versions)  # the stalest turn
        return Completion(
            prompt_ids=self.prompt,
            output_ids=self.ids,
            output_logprobs=self.logprobs,
            finish_reason=self.finish_reason or "stop",
            weight_version=version,
            info={
                "turns": self.turns,
                "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors,
                "stop_reason": self.stop_reason,
            },
            output_mask=self.mask,
        )


class MultiTurnEngine(RolloutEngine):
    """A rollout engine whose samples are tool-using trajectories, driven over ``engine`` (any
    :class:`RolloutEngine`: embedded or SGLang), one engine request per trajectory and turn.

    Per turn, every unfinished trajectory asks for min(``max_new_tokens``, what
    ``tools.max_total_tokens`` leaves) tokens, with ``tools.call_end`` (when it is one token) added
    to the stop tokens. A turn ending in a tool call (:func:`parse_tool_call`) gets the tool's
    result (:class:`ToolRegistry`: failures, hangs and garbage come back as error text) appended as
    a masked turn, unless it is the last allowed turn or the result would leave no room for another
    token. A trajectory stops with "stop" (an answer without a call, or a call in the last turn),
    "length" (a turn hit its token cap, or the budget is spent) or "abort" (the engine gave up).
    Each request carries the trajectory's ``affinity`` key, so an engine with several servers can
    keep a trajectory's turns on one server (its prefix cache holds the earlier turns).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        registry: ToolRegistry,
        tokenizer,
        config: ToolsConfig,
        template: Optional[ToolTurnTemplate] = None,
    ):
        self.engine = engine
        self.registry = registry
        self.tokenizer = tokenizer
        self.config = config
        self.template = template or ToolTurnTemplate.from_chat_template(tokenizer, config.result_role)
        check_text_tokenisation(tokenizer)
        end = tokenizer(config.call_end, add_special_tokens=False)["input_ids"]
        self.call_end_id: Optional[int] = end[0] if len(end) == 1 else None
        self._keys = itertools.count()

    @property
    def rejected_samples(self) -> int:
        return getattr(self.engine, "rejected_samples", 0)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1, affinity=None
    ) -> List[List[Completion]]:
        """``n`` trajectories per prompt; result[i][j] is prompt i's j-th (see the class docstring)."""
        validate_prompts(prompts, n)
        trajectories = [_Trajectory(list(p), next(self._keys)) for p in prompts for _ in range(n)]
        stop = tuple(params.stop_token_ids) + (() if self.call_end_id is None else (self.call_end_id,))
        for turn in range(self.config.max_turns):
            active = [t for t in trajectories if t.finish_reason is None]
            if not active:
                break
            self._policy_turn(active, dataclasses.replace(params, stop_token_ids=stop), turn)
            calling = [t for t in active if t.finish_reason is None]
            self._tool_turns(calling, last_turn=turn == self.config.max_turns - 1)
        return [[t.completion() for t in trajectories[i * n : (i + 1) * n]] for i in range(len(prompts))]

    def _policy_turn(self, active: List[_Trajectory], params: SamplingParams, turn: int) -> None:
        """One engine request per trajectory of ``active``, batched by token cap; parses each turn's call."""
        by_cap: Dict[int, List[_Trajectory]] = {}
        for t in active:
            cap = min(params.max_new_tokens, self.config.max_total_tokens - t.tokens())
            if cap < 1:
                t.finish("length", "token_budget")
            else:
                by_cap.setdefault(cap, []).append(t)
        for batch, (cap, group) in enumerate(sorted(by_cap.items())):
            seed = None if params.seed is None else params.seed + _TURN_SEED_STRIDE * (turn * 64 + batch)
            answers = self.engine.generate(
                [t.prompt + t.ids for t in group],
                dataclasses.replace(params, max_new_tokens=cap, seed=seed),
                n=1,
                affinity=[t.key for t in group],
            )
            for t, (completion,) in zip(group, answers):
                self._take_turn(t, completion, params)

    def _take_turn(self, t: _Trajectory, completion: Completion, params: SamplingParams) -> None:
        if completion.routed_experts is not None:
            raise ValueError("multi-turn rollouts (tools.enabled) do not support routing replay (train.routing_replay)")
        t.add(completion.output_ids, completion.output_logprobs, policy=True)
        t.versions.append(completion.weight_version)
        t.turns += 1
        t.call, t.turn_end = None, ""
        if completion.finish_reason != "stop":
            t.finish(completion.finish_reason, completion.finish_reason)
            return
        ids = list(completion.output_ids)
        turn_end = ""
        if ids and ids[-1] in params.stop_token_ids and ids[-1] != self.call_end_id:
            turn_end = self.tokenizer.decode(ids[-1:], skip_special_tokens=False)
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        call = parse_tool_call(text, self.config.call_format, self.config.call_start, self.config.call_end)
        if call is None:
            t.finish("stop", "answer")
        t.call, t.turn_end = call, turn_end

    def _tool_turns(self, calling: List[_Trajectory], last_turn: bool) -> None:
        """Run the calls of ``calling`` and append each result as a masked tool turn."""
        if last_turn:
            for t in calling:
                t.finish("stop", "max_turns")
            return
        for t, result in zip(calling, self.registry.call_all([t.call for t in calling])):
            t.tool_calls += 1
            t.tool_errors += int(result.error)
            ids = self.template.ids(self.tokenizer, result.text, t.turn_end)
            if t.tokens() + len(ids) >= self.config.max_total_tokens:
                t.finish("length", "token_budget")
                continue
            t.add(ids, [0.0] * len(ids), policy=False)

    # -- the rest of the engine interface: the inner engine's ---------------------------------

    def update_weights(self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_hf_tensors, version)

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def interrupt_generation(self) -> None:
        # the turn in progress raises; so does the next turn's, once the tool calls between them return
        self.engine.interrupt_generation()

    def clear_interrupt(self) -> None:
        self.engine.clear_interrupt()

    def __getattr__(self, name: str):
        # The inner engine's own methods (SGLang's push_part, commit_weights, flush_cache, ...).
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def shutdown(self) -> None:
        self.registry.close()
        self.engine.shutdown()
