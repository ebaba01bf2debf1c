"""The step-time model against published runs: every row of benchmarks/RESULTS.md's calibration
table within the band, so a change to a constant that breaks calibration fails here."""

import pytest

from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.planning.calibration import BAND, PUBLISHED_RUNS, predict
from megatron_zcpo.planning.decode_rate import generation_time


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda run: run.name)
def test_prediction_within_the_band_of_the_published_figure(run):
    ratio = predict(run) / run.published_s
    assert 1 - BAND <= ratio <= 1 + BAND, f"{run.name}: predicted {predict(run):.1f} s vs {run.published_s} s"


def test_the_results_table_quotes_the_predictions():
    from pathlib import Path

    results = (Path(__file__).parents[2] / "benchmarks" / "RESULTS.md").read_text()
    for run in PUBLISHED_RUNS:
        assert f"| {run.name} |" in results and f"| {predict(run):,.1f} |" in results, run.name


def test_the_step_waits_for_its_longest_response_and_the_batch_is_bounded_by_requests():
    """Llama-3.1-8B on 16 TP1 servers, 2,048 samples of 800 tokens: each server holds its 128
    requests, not its KV pool's ~300; the longest 3,900-token response decodes at a small batch for
    tens of seconds, longer than the bulk."""
    model = preset_model_config("Llama-3.1-8B")
    few = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    assert few.batch == pytest.approx(128)
    assert few.tail_s > few.bulk_s and few.seconds == few.tail_s and 20 < few.tail_s < 120
    many = generation_time(model, 2048 * 8, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    assert many.batch < 1024 and many.bulk_s > few.bulk_s * 4
