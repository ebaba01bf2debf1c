"""Multi-turn rollouts through the SGLang client: one request per turn, every turn of a trajectory on one server."""

from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.python_function import PythonFunctionTool, calculate
from megatron_zcpo.agent_tools.registry import ToolRegistry
from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.multi_turn import MultiTurnEngine
from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.multi_turn_doubles import ScriptedEngine, chatml_tokenizer


def test_turns_of_a_trajectory_stay_on_one_server():
    tokenizer = chatml_tokenizer()

    def script(text, turn):  # q0-q2 answer at once: the later turns' requests are fewer, in another order
        direct = any(f"q{i}<" in text for i in range(3))
        return "<tool_call>calculator 12*34</tool_call>" if turn == 0 and not direct else "answer<|im_end|>"

    backends = [ScriptedEngine(tokenizer, script), ScriptedEngine(tokenizer, script)]
    servers = [MockSGLangServer(backend) for backend in backends]
    for server in servers:
        server.__enter__()
    try:
        config = SGLangEngineConfig(server_urls=[s.url for s in servers], max_concurrency=8, request_timeout_s=10.0)
        tools = ToolsConfig(enabled=True, call_format="plain", registry={"calculator": {"kind": "calculator"}})
        registry = ToolRegistry([PythonFunctionTool("calculator", calculate)])
        with MultiTurnEngine(SGLangEngine(config), registry, tokenizer, tools) as engine:
            prompts = [
                tokenizer(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
                    "input_ids"
                ]
                for i in range(12)
            ]
            groups = engine.generate(
                prompts, SamplingParams(max_new_tokens=30, stop_token_ids=(tokenizer.eos_token_id,)), n=1
            )
    finally:
        for server in servers:
            server.__exit__(None, None, None)
    assert [c.info["tool_calls"] for group in groups for c in group] == [0] * 3 + [1] * 9
    # Each server saw both turns of the trajectories it served: a second turn's request extends a
    # first turn's request (+ its answer + the tool turn) that reached the same server.
    for backend in backends:
        firsts = [p for p, _, _ in backend.requests if tokenizer.decode(p).count("assistant") == 1]
        seconds = [p for p, _, _ in backend.requests if tokenizer.decode(p).count("assistant") == 2]
        assert all(any(second[: len(first)] == first for first in firsts) for second in seconds)
    assert sum(len(b.requests) for b in backends) == 21 and all(b.requests for b in backends)
