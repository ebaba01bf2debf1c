"""The demo's summary table shows how often the policy called a tool before and after (multi-turn tasks)."""

from rich.console import Console

from megatron_zcpo.cli.demo import print_run_summary

SUMMARY = dict(before=0.2, after=0.8, gain=0.6, se=0.01, z=60.0, problems=8, reward=0.5, kl=0.1, length=18.0, steps=4)


def _printed(summary):
    console = Console(record=True, width=200)
    print_run_summary("zcpo", 1, summary, console)
    return console.export_text()


def test_tool_columns_appear_with_tool_use_only():
    text = _printed({**SUMMARY, "tool_call_fraction_before": 0.25, "tool_call_fraction_after": 0.95})
    assert "tool calls before" in text and "0.250" in text and "0.950" in text
    assert "tool calls" not in _printed(SUMMARY)
