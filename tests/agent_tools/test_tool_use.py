"""Tools (megatron_zcpo/agent_tools): the calculator, Python-function tools, the sandboxed code tool, parsing, config."""

import os
import time
import warnings

import pytest

from megatron_zcpo.agent_tools.base import as_result_text
from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.parser import parse_tool_call
from megatron_zcpo.agent_tools.python_function import calculate
from megatron_zcpo.agent_tools.registry import ToolRegistry, build_tool
from megatron_zcpo.agent_tools.sandbox import CodeTool


def test_calculator_values_and_refusals():
    assert calculate("123 * 456") == 56088
    assert calculate(expression="(7 - 9) * -3 + 10 // 3") == 9
    assert calculate("1_000 * 1.5e3") == 1_500_000
    bad_inputs = (
        "__import__('os')",
        "2 ** 10",
        "abs(-1)",
        "1 +",
        "9" * 70 + " * 10",
        "1if 2 else 3",
        "'\\d'",
        "0x1for",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bad in bad_inputs:
            with pytest.raises(ValueError):
                calculate(bad)
    assert caught == []  # the parser's SyntaxWarnings would go to the trainer's stderr


def test_results_as_text():
    assert as_result_text(408, 100).text == "408" and as_result_text(2.0, 100).text == "2"
    assert as_result_text("x" * 50, 10).text.startswith("x" * 10) and "cut" in as_result_text("x" * 50, 10).text
    for garbage in (None, float("nan"), object(), True, b"\xff\xfe"):
        assert as_result_text(garbage, 100).error


def test_parse_calls():
    hermes = parse_tool_call(
        'think <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>\n', "hermes"
    )
    assert (hermes.name, hermes.arguments, hermes.error) == ("calc", {"expression": "1+2"}, None)
    encoded_twice = parse_tool_call('<tool_call>{"name": "c", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes")
    assert encoded_twice.arguments == {"a": 1}
    assert parse_tool_call("<tool_call>{oops</tool_call>", "hermes").error.startswith("the tool call is not JSON")
    assert parse_tool_call('<tool_call>["calc"]</tool_call>', "hermes").error
    plain = parse_tool_call("<tool_call>calculator 12 * 34</tool_call>", "plain")
    assert (plain.name, plain.arguments) == ("calculator", "12 * 34")
    assert parse_tool_call("the answer is 3", "plain") is None
    assert parse_tool_call("<tool_call>calculator 1+", "plain") is None  # cut before its end: no call


def test_registry_from_config_and_python_function_tools():
    config = ToolsConfig(
        enabled=True,
        registry={"calc": {"kind": "calculator"}, "upper": {"kind": "python", "function": "string:capwords"}},
    )
    config.validate()
    registry = ToolRegistry.from_config(config)
    calls = [
        parse_tool_call(f"<tool_call>{body}</tool_call>", "hermes")
        for body in (
            '{"name": "calc", "arguments": {"expression": "6*7"}}',
            '{"name": "upper", "arguments": {"s": "hello world"}}',
            '{"name": "nope", "arguments": {}}',
        )
    ]
    results = registry.call_all([calls[0], None, calls[1], calls[2]])
    assert results[0].text == "42" and results[1] is None and results[2].text == "Hello World"
    assert results[3].error and "unknown tool 'nope'" in results[3].text
    registry.close()


@pytest.mark.parametrize(
    "registry,key",
    [
        ({"x": {"kind": "shell"}}, "tools.registry.x.kind"),
        ({"x": {"kind": "python"}}, "tools.registry.x.function"),
        ({}, "tools.registry"),
    ],
)
def test_config_errors_name_the_key(registry, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ToolsConfig(enabled=True, registry=registry).validate()
    with pytest.raises(ValueError, match="tools.max_turns"):
        ToolsConfig(max_turns=0).validate()
    with pytest.raises(ValueError, match="unknown options"):
        build_tool("py", {"kind": "code", "cpu": 3})
    with pytest.raises(ValueError, match=r"tools\.registry\.py\.memory_mb must be a positive number"):
        build_tool("py", {"kind": "code", "memory_mb": 0})
    with pytest.raises(ValueError, match=r"tools\.registry\.py\.packages: package 'no_such_package' is not installed"):
        build_tool("py", {"kind": "code", "packages": ["no_such_package"]})


def test_the_registry_waits_for_the_code_tools_own_limit():
    """A code tool's calls end by its own timeout_s, with every process: the registry waits for that even
    past tools.timeout_s (returning first would leave the call's processes running)."""
    registry = ToolRegistry([CodeTool(timeout_s=3, packages=[])], timeout_s=0.2)
    code = ("import time; time.sleep(0.5); print('slow')", "while True: pass")
    slow, hung = registry.call_all([parse_tool_call(f"<tool_call>python {c}</tool_call>", "plain") for c in code])
    assert slow.text == "slow\n"
    assert hung.error and "did not finish within 3 s" in hung.text
    registry.close()


def test_code_tool_runs_code_in_its_own_process():
    tool = CodeTool(timeout_s=5, packages=[])
    assert tool.run(f"import os; print(6 * 7, os.getpid() != {os.getpid()})") == "42 True\n"
    assert tool.run({"code": "print('hi')"}) == "hi\n"
    failed = tool.run("raise ValueError('bad input')")
    assert failed.error and "ValueError: bad input" in failed.text


def test_code_tool_limits_time_and_memory():
    start = time.monotonic()
    hung = CodeTool(timeout_s=1, packages=[]).run("while True: pass")
    assert hung.error and "did not finish within 1 s" in hung.text and time.monotonic() - start < 5
    hog = CodeTool(timeout_s=10, memory_mb=200, packages=[]).run("x = bytearray(1_000_000_000); print(len(x))")
    assert hog.error and "MemoryError" in hog.text  # RLIMIT_AS per process
