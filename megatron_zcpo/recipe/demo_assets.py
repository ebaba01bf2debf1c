"""The embedded default for the CPU demo: a trained BPE tokenizer and a tiny Qwen2 warmed up by SFT.

Everything is built offline and deterministically from procedural arithmetic tasks
(reasoning-gym), then cached as a Hugging Face model directory, so the demo exercises the same
path as a cluster run: HF checkpoint -> Megatron -> RL -> HF weights pushed to the rollout engine.
The warm-up is deliberately short (it stops at a target accuracy) so that RL has room to improve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"  # tokens of the calculator task's tokenizer only
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class DemoSpec:
    """What the embedded default is made of; its hash names the cache entry."""

    task: str = "basic_arithmetic"
    # Two-digit addition: ~45% of the problems carry, and every held-out problem needs the same
    # digit-by-digit skill as the trained ones (no answer can be memorised).
    task_options: Tuple[Tuple[str, object], ...] = (
        ("min_terms", 2),
        ("max_terms", 2),
        ("min_digits", 2),
        ("max_digits", 2),
        ("operators", ("+",)),
        ("allow_parentheses", False),
        ("allow_negation", False),
    )
    instruction: str = "Put the final answer in \\boxed{}."
    # Share of the warm-up's responses that work a chain sum out step by step before the boxed
    # answer (drawn per record); the rest give the answer alone. 0: every response is the answer.
    worked_fraction: float = 0.0
    # Share of the warm-up's responses that call the calculator tool (a plain-format call, the tool's
    # turn, then the boxed result); the rest answer at once. 0: no tool tokens in the tokenizer.
    tool_fraction: float = 0.0
    max_response_tokens: int = 12  # the warm-up checks' generation cap (the RL config has its own)
    seed: int = 11
    size: int = 8000  # records drawn (of 8,100 distinct problems; repeats are merged)
    held_out_fraction: float = 0.15  # of the distinct expressions: never trained on, evaluated
    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    sft_seed: int = 0
    sft_lr: float = 1e-3
    sft_batch_size: int = 64
    sft_max_steps: int = 1500
    # Checked often: greedy accuracy jumps from ~0.1 to ~0.6 within ~50 steps, and where that jump
    # starts depends on the CPU type's float kernels; a check every 10 steps stops within ~0.1 of the
    # target wherever it starts (every 50 steps could stop anywhere from 0.3 to 0.6).
    sft_eval_every: int = 10
    sft_eval_problems: int = 128  # held-out problems in each warm-up check (greedy)
    sft_target_accuracy: float = 0.3  # held-out greedy accuracy at which the warm-up stops
    version: int = 4

    @property
    def options(self) -> Dict[str, object]:
        return {key: value for key, value in self.task_options}

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if not fields["tool_fraction"]:  # added later: the tool-free tasks keep their cache entries
            del fields["tool_fraction"]
        payload = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$ZCPO_CACHE`` or ``~/.cache/megatron_zcpo``."""
    return Path(os.environ.get("ZCPO_CACHE", Path.home() / ".cache" / "megatron_zcpo"))


def demo_records(spec: DemoSpec, split: str):
    """The demo's prompt records: ``split`` "train" (SFT warm-up and RL) or "eval" (one record per
    held-out expression: problems neither the warm-up nor RL ever sees)."""
    import random

    from megatron_zcpo.data.procedural import reasoning_gym_records

    records = reasoning_gym_records(spec.task, spec.size, spec.seed, spec.instruction, **spec.options)
    expressions = sorted({r.extra_info["expression"] for r in records})
    random.Random(spec.seed).shuffle(expressions)
    held_out = set(expressions[: max(1, int(len(expressions) * spec.held_out_fraction))])
    if split == "train":
        return [r for r in records if r.extra_info["expression"] not in held_out]
    if split != "eval":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    first = {}
    for record in records:
        first.setdefault(record.extra_info["expression"], record)
    return [first[e] for e in sorted(held_out)]


def response_text(answer: str, steps: Sequence[str] = ()) -> str:
    """A supervised response: the worked ``steps`` one a line (none: the answer alone), then the boxed
    answer and the end-of-turn token."""
    return "".join(f"{step}\n" for step in steps) + f"\\boxed{{{answer}}}{EOS}"


def tool_turn_text(result: str) -> str:
    """The calculator's turn between two policy turns, as the demo's chat template renders a ``tool``
    message after an assistant turn that stopped at its call's end (what the rollout appends)."""
    return f"{EOS}\n{BOS}tool\n{result}{EOS}\n{BOS}assistant\n"


def warmup_turns(spec: DemoSpec, record) -> List[Tuple[str, bool]]:
    """``record``'s supervised response as (text, trained) pieces: a call of the calculator on the
    record's expression, the tool's turn (not trained) and the boxed answer for a
    ``spec.tool_fraction`` share of the records (drawn per record); else :func:`warmup_response`."""
    import random

    if spec.tool_fraction and random.Random(f"tool:{spec.seed}:{record.uid}").random() < spec.tool_fraction:
        call = f"{CALL_START}calculator {record.extra_info['expression']}{CALL_END}"
        return [(call, True), (tool_turn_text(record.answer), False), (response_text(record.answer), True)]
    return [(warmup_response(spec, record), True)]


def warmup_response(spec: DemoSpec, record) -> str:
    """``record``'s supervised response: worked out step by step
    (:func:`megatron_zcpo.data.procedural.worked_steps` of its expression) for a
    ``spec.worked_fraction`` share of the records, drawn per record from ``spec.seed`` and its uid;
    the answer alone for the others."""
    import random

    from megatron_zcpo.data.procedural import worked_steps

    if spec.worked_fraction and random.Random(f"{spec.seed}:{record.uid}").random() < spec.worked_fraction:
        return response_text(record.answer, worked_steps(record.extra_info["expression"]))
    return response_text(record.answer)


def train_tokenizer(spec: DemoSpec, records):
    """A byte-level BPE (single digits kept apart) trained on the demo's prompts and responses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[PAD, BOS, EOS] + ([CALL_START, CALL_END] if spec.tool_fraction else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = []
    for record in records:
        response = "".join(text for text, _ in warmup_turns(spec, record))
        corpus.append(f"user\n{record.messages[0]['content']}\nassistant\n{response}")
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=None, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(spec: DemoSpec, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        torch_dtype="float32",
    )


def _encode_examples(spec: DemoSpec, tokenizer, records) -> List[Tuple[List[int], List[bool]]]:
    """(prompt + response token ids, which of them are trained) per record; each turn is tokenised on
    its own and laid end to end, as a multi-turn rollout lays them (a tool's turn is not trained)."""
    examples = []
    for record in records:
        prompt = tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        trained = [False] * len(ids)
        for text, train in warmup_turns(spec, record):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, trained = ids + piece, trained + [train] * len(piece)
        examples.append((ids, trained))
    return examples


@torch.no_grad()
def greedy_accuracy(model, tokenizer, records, max_new_tokens: int = 12) -> float:
    """Share of ``records`` whose greedy response's boxed answer is right (math-verify)."""
    from megatron_zcpo.rewards.math import math_answer_is_correct

    model.eval()
    correct = 0
    eos = tokenizer.convert_tokens_to_ids(EOS)
    for start in range(0, len(records), 64):
        chunk = records[start : start + 64]
        prompts = [tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in chunk]
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(len(e) for e in encoded)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(e) for e in encoded])[:, None]).long()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for record, row in zip(chunk, out[:, width:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            correct += int(math_answer_is_correct(text, record.answer))
    model.train()
    return correct / max(len(records), 1)


def supervised_warmup(spec: DemoSpec, tokenizer, records, eval_records, log: Callable[[str], None] = print):
    """Train a fresh tiny Qwen2 on (prompt, boxed answer) pairs until greedy accuracy reaches the target."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(spec.sft_seed)
    model = Qwen2ForCausalLM(_hf_config(spec, tokenizer))
    examples = _encode_examples(spec, tokenizer, records)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.sft_seed)
    accuracy = 0.0
    for step in range(1, spec.sft_max_steps + 1):
        batch = [examples[int(i)] for i in torch.randint(len(examples), (spec.sft_batch_size,), generator=generator)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for row, (sequence, trained) in enumerate(batch):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            labels[row, : len(sequence)] = torch.where(torch.tensor(trained), torch.tensor(sequence), -100)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % spec.sft_eval_every == 0:
            accuracy = greedy_accuracy(
                model, tokenizer, eval_records[: spec.sft_eval_problems], spec.max_response_tokens
            )
            if step % 50 == 0 or accuracy >= spec.sft_target_accuracy:
                log(f"warm-up step {step}: loss {loss.item():.3f}, greedy accuracy {accuracy:.2f}")
            if accuracy >= spec.sft_target_accuracy:
                break
    return model, accuracy


def build_demo_assets(
    spec: DemoSpec = DemoSpec(), cache_dir: Optional[Path] = None, log: Callable[[str], None] = print
) -> Path:
    """The cached directory of the embedded default (built on first use, atomically): an HF model
    (config.json, model.safetensors, tokenizer files) plus train.jsonl / eval.jsonl prompts."""
    root = Path(cache_dir or default_cache_dir())
    target = root / f"demo-{spec.digest()}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    # One thread: the warm-up's result then does not depend on the machine's core count, and a
    # second OpenMP thread costs far more than it gains on a busy 2-core machine (measured 13x CPU).
    torch.set_num_threads(1)
    log(f"building the embedded default in {target} (once; cached afterwards)")
    train, held_out = demo_records(spec, "train"), demo_records(spec, "eval")
    tokenizer = train_tokenizer(spec, train + held_out)  # the vocabulary covers every problem's text
    model, accuracy = supervised_warmup(spec, tokenizer, train, held_out, log=log)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for split, records in (("train", train), ("eval", held_out)):  # plain {prompt, answer} JSONL
        with open(tmp / f"{split}.jsonl", "w") as handle:
            for record in records:
                handle.write(json.dumps({"prompt": record.messages[0]["content"], "answer": record.answer}) + "\n")
    (tmp / "demo_spec.json").write_text(
        json.dumps({**dataclasses.asdict(spec), "warmup_greedy_accuracy": accuracy}, indent=2, default=str)
    )
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target
