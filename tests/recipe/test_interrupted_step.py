"""The interruptible step: a stop during a step's rollout abandons that step within seconds (its SGLang
requests aborted on the server), the run saves the state the last completed step left and exits 75, and
the rerun continues exactly (sync); overlapped and asynchronous runs stop as fast and resume without
losing or repeating a prompt. The SGLang double's requests of the later steps never answer ("hang"):
without the interruptible step these runs would wait for them until the request timeout."""

import os
import signal
import subprocess
import threading
import time

from megatron_zcpo.testing import run_distributed
from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - the fixture is used by name
from tests.recipe.test_exact_resume import NO_EVAL, _command, _config, _step_metrics, _train

PROMPTS, SAMPLES = 4, 2  # write_config's rollout: a step's rollout is PROMPTS x SAMPLES /generate requests
PER_STEP = PROMPTS * SAMPLES


def _server(model_dir, **release):
    """The SGLang double serving the tiny model, sampling each request with its seed (reproducible);
    ``release``: MockSGLangServer's release and continuous batching."""
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.testing.mock_server import MockSGLangServer

    backend = EmbeddedEngine(model_config_from_hf(read_hf_config(model_dir)), seed=7)
    return MockSGLangServer(backend, deterministic_inference=True, **release)


def _sglang(url, weights, **more):
    # (room for every request the async producer keeps in flight: the hanging ones hold their places)
    client = {"weight_sync": "disk", "weight_dir": str(weights), "sampling_seeds": True, "max_concurrency": 32}
    return {"engine": "sglang", "sglang": {"server_urls": [url], "client": client}, **more}


def _generates(server, action):
    """How many /generate requests the server took with ``action`` ("ok", "hang")."""
    return sum(path == "/generate" and what == action for path, what in list(server.events))


def _wait_until(condition, process=None, timeout=600):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_stop_during_the_rollout_abandons_the_step_within_seconds_and_the_rerun_continues_exactly(
    tmp_path, tiny_model
):
    """TP2 through `zcpo train`: SIGUSR1 to the launcher while step 2's requests are in flight -> rank 0
    stops the rollout (its requests aborted on the server), both ranks stop, the checkpoint of step 1 holds
    the prompt stream and generators as step 2 began, exit 75; the rerun's steps 2 and 3 equal an
    uninterrupted run's."""
    with _server(tiny_model) as server:

        def config(name):
            rollout = _sglang(server.url, tmp_path / name / "weights")
            return _config(
                tmp_path / name, tiny_model, train={"steps": 3}, checkpoint={"every": 0}, eval=NO_EVAL, rollout=rollout
            )

        _train(config("a"))
        expected = _step_metrics(tmp_path / "a" / "run")
        assert _generates(server, "ok") == 3 * PER_STEP  # one round per step: PER_STEP requests each
        server.faults["/generate"] = [None] * PER_STEP + ["hang"] * PER_STEP  # step 2's never answer
        path = config("b")
        command, env = _command(path)
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        _wait_until(lambda: _generates(server, "hang") == PER_STEP, process)  # step 2 generating
        time.sleep(0.5)
        os.kill(process.pid, signal.SIGUSR1)
        signalled = time.monotonic()
        _wait_until(lambda: len(server.aborted_rids) == PER_STEP, process, timeout=120)
        aborted_s = time.monotonic() - signalled
        _, stderr = process.communicate(timeout=300)
        exited_s = time.monotonic() - signalled
        print(f"stop -> requests aborted on the server {aborted_s:.2f} s, -> exit 75 {exited_s:.2f} s")
        assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
        assert "stopped at step 1 after SIGUSR1 (step 2 abandoned during its rollout; checkpoint of step 1" in stderr
        assert aborted_s < 10 and exited_s < 60, (aborted_s, exited_s)
        assert (tmp_path / "b" / "run" / "checkpoints" / "latest").read_text() == "step_00000001"
        server.faults.clear()
        assert "at step 1" in _train(path).stdout
    got = _step_metrics(tmp_path / "b" / "run")
    assert sorted(got) == [1, 2, 3]
    for step in (2, 3):
        assert got[step] == expected[step], step


def _request_stop_once_hanging(server, events_before, hang, stop_file, requested):
    """Once ``hang`` requests after the server's first ``events_before`` events hang, write a SIGUSR1 to
    ``stop_file`` as the launcher relays one; appends the time to ``requested``."""
    from megatron_zcpo.training.preemption import write_stop_request

    _wait_until(lambda: sum(what == "hang" for _, what in server.events[events_before:]) == hang)
    time.sleep(0.5)
    requested.append(time.monotonic())
    write_stop_request(stop_file, signal.SIGUSR1)


def _stopped_and_resumed(rank, world, paths, stop_file, model_dir):
    """One process (TP1) beside the SGLang double: for each (mode, config, requests answered, requests that
    hang), a run stopped through ``stop_file`` (the launcher's relay) once the hanging ones are all in flight,
    then its resume. Returns {mode: (Preempted.step, abandoned, message, seconds from the request to the stop,
    aborts the server saw meanwhile)}."""
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training
    from megatron_zcpo.training.preemption import STOP_FILE_ENV, Preempted

    os.environ[STOP_FILE_ENV] = stop_file
    results = {}
    # 0.5.23 with continuous batching: an asynchronous push holds the requests in flight ("retract"), so
    # none is sent twice and the double's answered/hanging requests are exactly the ones counted
    with _server(model_dir, release="0.5.23", continuous=True) as server:
        for mode, path, answered, hang in paths:
            server.faults["/generate"] = [None] * answered + ["hang"] * hang
            aborts_before, requested = len(server.aborted_rids), []
            threading.Thread(
                target=_request_stop_once_hanging,
                args=(server, len(server.events), hang, stop_file, requested),
                daemon=True,
            ).start()
            overrides = [f"rollout.sglang.server_urls=[{server.url}]"]
            try:
                run_training(load_run_config(str(path), overrides))
                raise AssertionError(f"{mode}: the run was not stopped")
            except Preempted as stop:
                stop_s = time.monotonic() - requested[0]
                results[mode] = (stop.step, stop.abandoned, str(stop), stop_s, len(server.aborted_rids) - aborts_before)
            os.remove(stop_file)
            server.faults.clear()
            run_training(load_run_config(str(path), overrides))  # resumed (checkpoint.resume=auto)
    return results


def _loop_state(run_dir, step):
    from megatron_zcpo.checkpoint.io import read_checkpoint_file

    return read_checkpoint_file(run_dir / "checkpoints" / f"step_{step:08d}", "trainer_state.pt")["loop"]


def test_overlapped_and_asynchronous_runs_stop_within_seconds_and_resume_without_losing_a_prompt(tmp_path, tiny_model):
    """overlap: step 2's rollout (in flight while step 1 trains) hangs; the stop drops it, the checkpoint of
    step 1 holds no rollout in flight and the prompt stream before it, and the resumed run generates step 2
    on the checkpoint's weights (staleness 0, then 1 again), drawing every prompt once. async: the producer's
    groups admitted after step 1 hang, so step 3 waits for groups; the stop abandons it, the checkpoint of
    step 2 holds its groups in flight by prompt, and the resumed step 3 trains them."""
    common = dict(train={"steps": 3}, checkpoint={"every": 0, "keep_last": 3}, eval=NO_EVAL, parallel={"tensor": 1})
    paths = []
    for mode, answered, hang in (
        ("overlap", PER_STEP, PER_STEP),  # step 1's rollout answered; step 2's (launched before step 1 trains) hangs
        ("async", 2 * PER_STEP, 2 * PER_STEP),  # the first (k + 1) x B groups answered; the next two admissions hang
    ):
        (tmp_path / mode).mkdir()
        rollout = _sglang("http://unset", tmp_path / mode / "weights", mode=mode)
        paths.append((mode, write_config(tmp_path / mode, tiny_model, rollout=rollout, **common), answered, hang))
    stop_file = str(tmp_path / "stop_request")
    [results] = run_distributed(_stopped_and_resumed, 1, paths, stop_file, tiny_model, timeout=900)
    print({mode: f"{result[3]:.2f} s from the stop request to the stop" for mode, result in results.items()})

    step, abandoned, message, stop_s, aborted = results["overlap"]
    assert step == 1 and "after SIGUSR1" in message and stop_s < 30, results["overlap"]
    assert aborted == PER_STEP  # the rollout in flight ended on the server
    run = tmp_path / "overlap" / "run"
    saved = _loop_state(run, 1)
    assert saved["in_flight"] == {} and (saved["data"]["epoch"], saved["data"]["position"]) == (0, PROMPTS)
    records = _step_metrics(run)
    assert sorted(records) == [1, 2, 3]
    assert [records[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    final = _loop_state(run, 3)  # steps 1-3 and step 4's rollout in flight: each prompt drawn once
    assert final["data"]["position"] == 4 * PROMPTS and final["in_flight"]["step"] == 3

    step, abandoned, message, stop_s, _ = results["async"]
    assert (step, abandoned) == (2, True) and stop_s < 30, results["async"]
    assert "step 3 abandoned during its rollout; checkpoint of step 2" in message
    producer = _loop_state(tmp_path / "async" / "run", 2)["async"]
    assert producer["counts"]["taken"] == 2 * PROMPTS and producer["ready"] == []
    assert len(producer["in_flight"]) == 2 * PROMPTS  # the two hung admissions, regenerated on resume
    records = _step_metrics(tmp_path / "async" / "run")
    assert sorted(records) == [1, 2, 3] and records[3]["async/taken_total"] == 3 * PROMPTS
    assert all(r["rollout/staleness_max"] <= 1 for r in records.values())
