"""Test doubles of the multi-turn tests: a small ChatML tokenizer with tool-call tokens, and a scripted engine."""

from __future__ import annotations

from typing import Callable, List

from megatron_zcpo.rollout.engine import Completion, RolloutEngine

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer(template: str = CHATML):
    """A byte-level BPE (a few merges) whose tool-call markers and ChatML markers are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["user assistant tool calculator 12*34 = 408 answer think"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    return fast


class ScriptedEngine(RolloutEngine):
    """Answers with ``script(prompt_text, turn)`` (``turn``: how many assistant turns the prompt holds
    already), tokenised; log-prob of output token k is -(k+1)/100; stops at a stop token or the cap.
    Records every request's prompt ids, cap and affinity key."""

    def __init__(self, tokenizer, script: Callable[[str, int], str], version: int = 3):
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.requests: List[tuple] = []

    def generate(self, prompts, params, n=1, affinity=None):
        results = []
        for row, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            self.requests.append((list(prompt), params.max_new_tokens, None if affinity is None else affinity[row]))
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer(self.script(text, turn), add_special_tokens=False)["input_ids"]
            stops = [k for k, t in enumerate(ids) if t in params.stop_token_ids]
            cut = min(stops[0] + 1 if stops else len(ids), params.max_new_tokens)
            ids = ids[:cut]
            reason = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
            completion = Completion(list(prompt), ids, [-(k + 1) / 100 for k in range(len(ids))], reason, self.version)
            results.append([completion] * n)
        return results

    def update_weights(self, named_hf_tensors, version):
        self.version = version

    def weight_version(self):
        return self.version

    def shutdown(self):
        pass
