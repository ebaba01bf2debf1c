"""Prompt preparation (chat template, tokenization, length filter) and a seeded, resumable prompt stream."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_zcpo.data.config import DataConfig
from megatron_zcpo.data.procedural import reasoning_gym_records
from megatron_zcpo.data.records import DataError, PromptRecord, read_prompt_file

logger = logging.getLogger(__name__)


def render_prompt(
    messages: Sequence[Dict[str, str]], tokenizer, chat_template: str = "auto", enable_thinking: Optional[bool] = None
) -> Tuple[str, bool]:
    """The prompt text for ``messages`` and whether tokenizing it should add the tokenizer's special tokens.

    "auto" with a tokenizer that has a chat template: ``tokenizer.apply_chat_template(...,
    add_generation_prompt=True)`` (the template already holds BOS and the like: no special tokens added),
    with ``enable_thinking`` passed to the template when not None (Qwen3's thinking switch; a
    ``ValueError`` naming ``data.enable_thinking`` when the template does not read that variable).
    Otherwise plain text: "User: ...\\n\\nAssistant:" (roles capitalised, turns separated by a blank
    line), tokenized with the tokenizer's special tokens.
    """
    template = getattr(tokenizer, "chat_template", None) if chat_template == "auto" else None
    if enable_thinking is not None and "enable_thinking" not in (template or ""):
        raise ValueError(
            f"data.enable_thinking={enable_thinking}: the tokenizer's chat template does not read "
            f"'enable_thinking' (Qwen3's hybrid-thinking template does); leave it null"
        )
    if template:
        options = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **options
        ), False
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns + ["Assistant:"]), True


def tokenize_records(
    records: Sequence[PromptRecord],
    tokenizer,
    max_prompt_length: int,
    chat_template: str = "auto",
    enable_thinking: Optional[bool] = None,
) -> List[PromptRecord]:
    """Render (:func:`render_prompt`) and tokenize every record; records longer than
    ``max_prompt_length`` tokens are left out (and counted in a log line).

    Returns new records with ``prompt_text`` and ``prompt_ids`` set, in the input order.
    """
    rendered = [render_prompt(r.messages, tokenizer, chat_template, enable_thinking) for r in records]
    kept, too_long = [], []
    for add_special_tokens in (False, True):
        indices = [i for i, (_, add) in enumerate(rendered) if add == add_special_tokens]
        if not indices:
            continue
        encoded = tokenizer([rendered[i][0] for i in indices], add_special_tokens=add_special_tokens)["input_ids"]
        for i, ids in zip(indices, encoded):
            if len(ids) > max_prompt_length:
                too_long.append((i, len(ids)))
            else:
                kept.append((i, dataclasses.replace(records[i], prompt_text=rendered[i][0], prompt_ids=list(ids))))
    if too_long:
        first, length = min(too_long)
        logger.info(
            "left out %d of %d prompts longer than %d tokens (first: %s, %d tokens)",
            len(too_long),
            len(records),
            max_prompt_length,
            records[first].uid,
            length,
        )
    return [record for _, record in sorted(kept, key=lambda pair: pair[0])]


def load_records(config: DataConfig) -> List[PromptRecord]:
    """The untokenized records ``config`` names: all its files in order, or its reasoning-gym task."""
    config.validate()
    if config.task:
        return reasoning_gym_records(
            config.task, config.task_size, config.seed, config.task_instruction, **config.task_options
        )
    return [record for path in config.train_files for record in read_prompt_file(path, config.on_bad_row)]


class PromptDataset:
    """An endless, seeded stream of prompt records, epoch after epoch, that can resume exactly.

    Epoch e visits every record once, in a permutation drawn from ``(seed, e)`` (or in file order when
    ``shuffle`` is off). ``state_dict()`` saved after any ``next_batch`` and restored with
    ``load_state_dict()`` on the same records reproduces exactly the same subsequent batches.
    """

    def __init__(self, records: Sequence[PromptRecord], seed: int = 0, shuffle: bool = True):
        if not records:
            raise DataError("the prompt dataset is empty (every row was bad or longer than data.max_prompt_length)")
        self.records = list(records)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)
        # identifies the record list, so a resume on different data is refused instead of silently diverging
        self.fingerprint = hashlib.sha256("\n".join(r.uid for r in self.records).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next_batch(self, size: int) -> List[PromptRecord]:
        """The next ``size`` records; a batch that reaches the end of an epoch continues into the next."""
        if size < 0:
            raise ValueError(f"batch size must be >= 0, got {size}")
        batch: List[PromptRecord] = []
        while len(batch) < size:
            if self.position == len(self.records):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(size - len(batch), len(self.records) - self.position)
            batch.extend(self.records[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> Dict[str, Any]:
        """The stream position: epoch, position within it, and what identifies the data and order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); refuses a state saved for other data or order."""
        expected = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
            "fingerprint": self.fingerprint,
        }
        mismatched = {key: (state.get(key), value) for key, value in expected.items() if state.get(key) != value}
        if mismatched:
            details = ", ".join(f"{key}: saved {saved!r}, now {now!r}" for key, (saved, now) in mismatched.items())
            raise DataError(f"the saved data position belongs to a different dataset or order ({details})")
        if not 0 <= state["position"] <= len(self.records):
            raise DataError(f"saved data position {state['position']} is outside [0, {len(self.records)}]")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)


def build_prompt_dataset(config: DataConfig, tokenizer) -> PromptDataset:
    """Load, render, tokenize and length-filter the prompts of ``config`` into a :class:`PromptDataset`."""
    tokenized = tokenize_records(
        load_records(config), tokenizer, config.max_prompt_length, config.chat_template, config.enable_thinking
    )
    return PromptDataset(tokenized, seed=config.seed, shuffle=config.shuffle)
