"""The ``tools:`` section in the run config: cross-section checks, derived defaults, the servers' context."""

import pytest

from megatron_zcpo.data.config import DataConfig
from megatron_zcpo.data.dataset import load_records
from megatron_zcpo.recipe.config import build_run_config
from megatron_zcpo.recipe.timeouts import longest_new_tokens

TOOLS = {"enabled": True, "max_turns": 3, "max_total_tokens": 512, "registry": {"calc": {"kind": "calculator"}}}


ARCHITECTURE = {"family": "qwen2", "vocab_size": 64, "hidden_size": 32, "num_layers": 1, "num_attention_heads": 2}


def _config(**sections):
    model = {"architecture": ARCHITECTURE, "tokenizer": "."}
    return build_run_config({"model": model, "data": {"task": "basic_arithmetic", "max_prompt_length": 64}, **sections})


def test_tools_derive_the_overlong_cap_and_the_servers_request_size():
    config = _config(tools=TOOLS, rollout={"max_new_tokens": 32})
    assert config.reward.max_response_length == 96  # the policy's tokens over 3 turns of 32
    assert longest_new_tokens(config) == 512 - 64  # a late turn's request holds the earlier turns
    assert longest_new_tokens(_config(rollout={"max_new_tokens": 32})) == 32


@pytest.mark.parametrize(
    "sections,message",
    [
        ({"tools": {**TOOLS, "max_total_tokens": 64}}, "tools.max_total_tokens=64 must exceed data.max_prompt_length"),
        ({"tools": TOOLS, "train": {"routing_replay": "rollout"}}, "do not support train.routing_replay"),
        (
            {"tools": TOOLS, "rollout": {"max_new_tokens": 32}, "reward": {"max_response_length": 32}},
            "rollout.max_new_tokens x tools.max_turns = 96",
        ),
        ({"tools": {**TOOLS, "registry": {"x": {"kind": "shell"}}}}, "tools.registry.x.kind"),
        (
            {"tools": TOOLS, "eval": {"data": {"task": "basic_arithmetic", "chat_template": "plain"}}},
            "eval.data.chat_template='plain' differs from data.chat_template='auto'",
        ),
    ],
)
def test_mistakes_name_the_key(sections, message):
    with pytest.raises(Exception, match=message.replace(".", r"\.").replace("(", r"\(")):
        _config(**sections)


def test_system_prompt_goes_first_unless_there_is_one():
    records = load_records(DataConfig(task="basic_arithmetic", task_size=2, system_prompt="use the calculator"))
    assert [m["role"] for m in records[0].messages] == ["system", "user"]
    assert records[0].messages[0]["content"] == "use the calculator"
