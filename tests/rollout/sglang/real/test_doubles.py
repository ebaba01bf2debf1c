"""The mock server (megatron_zcpo/testing/mock_server.py, mock_answers.py) against the real SGLang of the same
release: the same request to both gets the same status and an answer of the same shape (keys and types),
with the same message where SGLang's is fixed. So the double cannot drift from what it imitates.

Deliberate differences (the mock is stricter): it refuses unknown top-level body fields, which SGLang ignores;
it has no tokenizer (``text`` is empty). The requests that kill the real server are in ``test_killers.py``.
"""

import threading
import time

import pytest

from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.real.raw import StreamingGenerate, call
from tests.rollout.sglang.test_sglang_client import ScriptedEngine


def shape(value):
    """The structure of a JSON value: dicts by key, a list by its first item, other values by type."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


@pytest.fixture
def mock(real_server, release):
    """A mock server launched as the real one (release, key, --context-length 128, 8,192-token KV pool)."""
    with MockSGLangServer(
        ScriptedEngine(), release=release, api_key=real_server.api_key, context_length=128, max_total_num_tokens=8192
    ) as server:
        yield server


def both(real_server, mock, path, body=None, **options):
    """(real answer, mock answer) of the same request, each (status, JSON or text)."""
    return (
        call(real_server.url, path, body, key=real_server.api_key, **options),
        call(mock.url, path, body, key=real_server.api_key, **options),
    )


def generate(prompt, **sampling):
    return {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, **sampling},
        "return_logprob": True,
    }


def test_generate_answers_have_the_releases_shape(real_server, mock):
    both(real_server, mock, "/flush_cache", {})  # no prefix cached: no cached_tokens_details
    real, double = both(real_server, mock, "/generate", generate([5, 6, 7]))
    assert real[0] == double[0] == 200
    assert shape(double[1]) == shape(real[1])
    assert (
        double[1]["meta_info"]["finish_reason"]
        == real[1]["meta_info"]["finish_reason"]
        == {"type": "length", "length": 4}
    )
    for server in (real_server, mock):  # a stop token: finish_reason names it
        first = call(server.url, "/generate", generate([5, 6, 7]), key=real_server.api_key)[1]["output_ids"][0]
        stopped = call(server.url, "/generate", generate([5, 6, 7], stop_token_ids=[first]), key=real_server.api_key)[1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        assert stopped["output_ids"] == [first]


@pytest.mark.parametrize(
    "name,body",
    [
        ("unknown sampling key", generate([5], bogus=1)),
        ("null sampling_seed", generate([5], sampling_seed=None)),
        ("prompt + new tokens over the context", generate(list(range(1, 101)), max_new_tokens=40)),
        ("prompt + new tokens = the context", generate(list(range(1, 101)), max_new_tokens=28)),
        ("prompt over the context", generate(list(range(1, 130)))),
        ("body that does not validate", {"input_ids": "abc"}),
    ],
)
def test_refusals_have_the_releases_status_and_body(real_server, mock, name, body):
    both(real_server, mock, "/flush_cache", {})
    real, double = both(real_server, mock, "/generate", body)
    assert real[0] == double[0], name
    assert shape(double[1]) == shape(real[1]), name
    if real[0] == 200:  # 0.5.23 serves prompt + new == context, cut as its scheduler cuts
        assert len(double[1]["output_ids"]) == len(real[1]["output_ids"]), name
    elif name == "unknown sampling key" and isinstance(real[1], dict):  # 0.5.23 lists its own keys after it
        assert double[1]["error"].split(", expected")[0] == real[1]["error"].split(", expected")[0]
    elif name != "body that does not validate":  # SGLang's fixed messages
        assert double[1] == real[1], name


def test_other_endpoints_answer_alike(real_server, mock, release, tmp_path):
    for path, body in (("/no_such_path", None), ("/flush_cache", {}), ("/get_model_info", None)):
        real, double = both(real_server, mock, path, body)
        assert real[0] == double[0] and (double[1] == real[1] or path == "/get_model_info"), path
    assert shape(double[1]["weight_version"]) == shape(real[1]["weight_version"]) == "str"
    real, double = both(real_server, mock, "/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
    assert real[0] == double[0] == 400 and shape(double[1]) == shape(real[1])
    assert double[1]["message"].split(":")[0] == real[1]["message"].split(":")[0] == "Failed to get weights iterator"
    real, double = (call(url, "/get_model_info") for url in (real_server.url, mock.url))  # without the key
    assert real == double == (401, {"error": "Unauthorized"})
    facts = ("version", "tp_size", "context_length", "max_total_num_tokens", "max_req_input_len", "skip_tokenizer_init")
    real, double = both(real_server, mock, "/get_server_info")
    assert {k: double[1][k] for k in facts} == {k: real[1][k] for k in facts}
    if release != "0.5.3.post3":  # outside a weight-update session
        bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
        for path, body in (("/update_weights_from_distributed", bucket), ("/end_weight_update", {})):
            real, double = both(real_server, mock, path, body)
            assert real == double, path


def test_flush_is_refused_while_a_request_runs(real_server, release):
    running = StreamingGenerate(real_server.url, real_server.api_key, [4, 4])
    running.start()
    running.wait_running()
    real = call(real_server.url, "/flush_cache", {}, key=real_server.api_key)
    call(real_server.url, "/abort_request", {"abort_all": True}, key=real_server.api_key)
    running.join(120)
    with MockSGLangServer(ScriptedEngine(), release=release, generate_delay_s=30) as mock:
        threading.Thread(target=call, args=(mock.url, "/generate", generate([4, 4])), daemon=True).start()
        while not mock.running_rids:
            time.sleep(0.01)
        assert call(mock.url, "/flush_cache", {}) == real and real[0] == 400


def pause_story(url, key, running_finish):
    """Pause while a request runs (``running_finish()``: its finish reason, once it ended), send one while
    paused (still unanswered 2 s later), continue: (the running one's finish reason, the held one's answer)."""
    assert call(url, "/pause_generation", {}, key=key)[0] == 200
    held = {}
    thread = threading.Thread(target=lambda: held.update(answer=call(url, "/generate", generate([3]), key=key)))
    thread.start()
    time.sleep(2.0)  # an answer takes well under a second
    assert thread.is_alive()  # held, not refused
    assert call(url, "/continue_generation", {}, key=key)[0] == 200
    thread.join(120)
    return running_finish(), held["answer"]


def test_pause_aborts_what_runs_and_holds_what_arrives(real_server, release):
    """Both hold a /generate that arrives while paused (the mock used to refuse it with 400) and end the
    one that runs as aborted."""
    running = StreamingGenerate(real_server.url, real_server.api_key, [3, 3])
    running.start()
    running.wait_running()
    real = pause_story(real_server.url, real_server.api_key, lambda: running.final["meta_info"]["finish_reason"])
    with MockSGLangServer(ScriptedEngine(), release=release, generate_delay_s=2) as mock:
        first = {}
        thread = threading.Thread(target=lambda: first.update(answer=call(mock.url, "/generate", generate([3]))))
        thread.start()
        while not mock.running_rids:
            time.sleep(0.01)

        def finish():
            thread.join(60)
            return first["answer"][1]["meta_info"]["finish_reason"]

        double = pause_story(mock.url, None, finish)
    assert real[0] == double[0] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert real[1][0] == double[1][0] == 200 and shape(double[1][1]) == shape(real[1][1])
