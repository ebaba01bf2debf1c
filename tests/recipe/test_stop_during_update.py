"""A stop during a step's update is taken at its next safe point (before the experience pass, before each
mini-batch), by every rank together even when one rank alone got it: the step abandoned (saved as the last
completed step left it, or left to the checkpoint that holds it), finished within checkpoint.stop_grace_s,
or left unsaved when finishing would outlast the grace; each resumed run equals the uninterrupted one."""

import os
import signal

import pytest

from megatron_zcpo.recipe.stopping import UpdateStopCheck
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.training.preemption import UpdateProgress
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - the fixture is used by name
from tests.recipe.test_exact_resume import NO_EVAL, _step_metrics
from tests.recipe.test_interrupted_step import _loop_state

PROMPTS = 4  # write_config's prompts per step


def _stop_at(stop_file, calibrate_call=None, update_call=None):
    """Patch the trainer so that its ``calibrate_call``-th calibration (after a step's experience pass) or ``update_call``-th mini-batch
    (1-based, this run) writes a SIGUSR1 to ``stop_file`` on the rank that reads it (a launcher's relay). Returns a function that undoes the patches."""
    from megatron_zcpo.training import trainer, update
    from megatron_zcpo.training.preemption import STOP_FILE_ENV, write_stop_request

    originals = {"calibrate": trainer.calibrate, "update": update.forward_backward}
    calls = {"calibrate": 0, "update": 0}

    def counted(kind, wanted, original):
        def call(*args, **kwargs):
            calls[kind] += 1
            result = original(*args, **kwargs)
            if calls[kind] == wanted and os.environ.get(STOP_FILE_ENV):  # the reading rank alone
                write_stop_request(stop_file, signal.SIGUSR1)
            return result

        return call

    trainer.calibrate = counted("calibrate", calibrate_call, originals["calibrate"])
    update.forward_backward = counted("update", update_call, originals["update"])

    def undo():
        trainer.calibrate, update.forward_backward = originals["calibrate"], originals["update"]

    return undo


def _stopped_and_resumed(rank, world, cases, stop_file):
    """Every rank: the reference run, then each case stopped (rank 1 alone reads ``stop_file``) and resumed.
    Returns {case: (Preempted.step, abandoned, message)}."""
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training
    from megatron_zcpo.training.preemption import STOP_FILE_ENV, Preempted

    results = {}
    for name, path, trigger in cases:
        if trigger is not None:
            if rank == 1:
                os.environ[STOP_FILE_ENV] = stop_file
            undo = _stop_at(stop_file, **trigger)
            try:
                run_training(load_run_config(str(path)))
                raise AssertionError(f"{name}: the run was not stopped")
            except Preempted as stop:
                results[name] = (stop.step, stop.abandoned, str(stop))
            finally:
                undo()
                if rank == 1:
                    os.environ.pop(STOP_FILE_ENV)
                    os.remove(stop_file)
        run_training(load_run_config(str(path)))  # the reference; or the resumed run (checkpoint.resume=auto)
    return results


CASES = {
    # stop request during step 2's experience pass and calibration: taken before its first mini-batch -> step 2 abandoned,
    # the checkpoint of step 1 written as step 2 began
    "before-first-minibatch": ({"every": 0}, {"calibrate_call": 2}),
    # during step 2's first mini-batch, the checkpoint of step 1 written before: abandoned, nothing saved
    "checkpoint-holds-it": ({"every": 1}, {"update_call": 3}),
    # during step 2's first mini-batch, step 1 unsaved, the finish fits the default grace: finished and saved
    # (its evaluation, due at step 2, skipped)
    "finished-in-grace": ({"every": 0}, {"update_call": 3}),
    # the same with no grace: exits unsaved, the rerun starts afresh
    "no-grace": ({"every": 0, "stop_grace_s": 0}, {"update_call": 3}),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("stops")
    common = dict(train={"steps": 3})
    cases = []
    for name, (checkpoint, trigger) in [("reference", ({"every": 0}, None)), *CASES.items()]:
        (root / name).mkdir()
        evaluation = {**NO_EVAL, "every": 2} if name == "finished-in-grace" else NO_EVAL
        path = write_config(
            root / name, tiny_model, checkpoint={"keep_last": 3, **checkpoint}, eval=evaluation, **common
        )
        cases.append((name, path, trigger))
    [results, _] = run_distributed(_stopped_and_resumed, 2, cases, str(root / "stop_request"), timeout=900)
    return root, results


def _latest(root, name):
    latest = root / name / "run" / "checkpoints" / "latest"
    return latest.read_text() if latest.exists() else None


def test_a_stop_before_the_first_minibatch_abandons_the_step_and_saves_the_last_completed_one(stopped):
    root, results = stopped
    step, abandoned, message = results["before-first-minibatch"]
    assert (step, abandoned) == (1, True), message
    assert "step 2 abandoned during its update; checkpoint of step 1" in message
    saved = _loop_state(root / "before-first-minibatch" / "run", 1)  # the prompt stream as step 2 began
    assert (saved["data"]["epoch"], saved["data"]["position"]) == (0, PROMPTS)


def test_a_stop_after_a_minibatch_leaves_the_step_to_the_checkpoint_that_holds_its_predecessor(stopped):
    root, results = stopped
    step, abandoned, message = results["checkpoint-holds-it"]
    assert (step, abandoned) == (1, True), message
    assert "step 2 abandoned during its update; checkpoint of step 1" in message


def test_a_stop_whose_finish_fits_the_grace_finishes_the_step_and_saves_it(stopped):
    root, results = stopped
    step, abandoned, message = results["finished-in-grace"]
    assert (step, abandoned) == (2, False) and "checkpoint written" in message, message
    assert _latest(root, "finished-in-grace") == "step_00000003"  # (after the resumed run's last step)
    assert not (root / "finished-in-grace" / "run" / "eval").exists()  # step 2's evaluation: no time for it


def test_a_stop_whose_finish_outlasts_the_grace_exits_unsaved(stopped):
    root, results = stopped
    step, abandoned, message = results["no-grace"]
    assert "step 2 stopped during its update after 1 of 2 mini-batches" in message, message
    assert "not saved: the resumed run continues from the start" in message
    assert "checkpoint.stop_grace_s=0 s" in message


def test_every_resumed_run_equals_the_uninterrupted_one(stopped):
    root, _ = stopped
    expected = _step_metrics(root / "reference" / "run")
    assert sorted(expected) == [1, 2, 3]
    for name in CASES:
        got = _step_metrics(root / name / "run")
        for step in (2, 3):
            assert got[step] == expected[step], (name, step)


class _Guard:
    """A PreemptionGuard's collective answers, scripted."""

    def __init__(self, stop, waited=0.0):
        self.stop, self.waited = stop, waited

    def stop_request(self, estimate, waited):
        return self.stop, (estimate, max(waited, self.waited))

    def seconds_since_request(self):
        return self.waited


@pytest.mark.parametrize(
    "synchronous, unsaved, done, seconds, last_save_s, waited, expected",
    [
        (True, 1, 0, 0.0, 5.0, 0.0, "SIGUSR1"),  # sync, untouched: abandon (and save the last step)
        (False, 1, 0, 0.0, 5.0, 0.0, None),  # overlap/async, untouched, unsaved: no pace yet, go on
        (False, 0, 0, 0.0, 5.0, 0.0, "SIGUSR1"),  # the checkpoint holds the last step: abandon
        (True, 0, 3, 30.0, 5.0, 0.0, "SIGUSR1"),  # trained in part, the checkpoint holds the last step
        (True, 2, 4, 400.0, 50.0, 0.0, "SIGUSR1"),  # 12 x 100 s + 50 s = 1,250 s > 300 s: exit unsaved
        (True, 2, 12, 240.0, 20.0, 0.0, None),  # 4 x 20 s + 20 s = 100 s <= 300: finish
        (True, 2, 12, 240.0, 20.0, 250.0, "SIGUSR1"),  # 100 s > 300 - 250 waited: exit unsaved
    ],
)
def test_update_stop_decisions(synchronous, unsaved, done, seconds, last_save_s, waited, expected):
    said = []
    check = UpdateStopCheck(
        _Guard("SIGUSR1", waited), 300.0, synchronous, lambda: unsaved, lambda: last_save_s, said.append
    )
    progress = UpdateProgress(done, 16, seconds)
    assert check(progress) == expected
    assert bool(said) == (expected is None and done > 0)  # "finishing the step" said once, when finishing
    assert (
        UpdateStopCheck(_Guard(None), 300.0, synchronous, lambda: unsaved, lambda: 0.0, said.append)(progress) is None
    )
