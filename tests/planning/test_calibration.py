"""The step-time model against published runs: every row of benchmarks/RESULTS.md's calibration
table within the band, so a change to a constant that breaks calibration fails here."""

from pathlib import Path

import pytest

from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.planning.calibration import BAND, PUBLISHED_RUNS, calibration_table, predict
from megatron_zcpo.planning.decode_rate import generation_time


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda run: run.name)
def test_prediction_within_the_band_of_the_published_figure(run):
    seconds, tokens = predict(run, preset_model_config(run.preset))
    if run.known_out:  # documented misses stay on their side, so a change that moves them is noticed
        fast_throughput = run.published_tokens_per_s_per_gpu and tokens / run.published_tokens_per_s_per_gpu > 1 + BAND
        assert seconds / run.published_s < 1 - BAND or fast_throughput, f"{run.name}: {seconds:.1f} s is no longer fast"
        return
    assert 1 - BAND <= seconds / run.published_s <= 1 + BAND, f"{run.name}: {seconds:.1f} s vs {run.published_s} s"
    if run.published_tokens_per_s_per_gpu:
        assert 1 - BAND <= tokens / run.published_tokens_per_s_per_gpu <= 1 + BAND, f"{run.name}: {tokens:.0f}"


def test_the_results_table_is_the_calibration_table():
    results = (Path(__file__).parents[2] / "benchmarks" / "RESULTS.md").read_text()
    assert calibration_table(preset_model_config) in results


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


def test_the_clients_cap_on_requests_in_flight_bounds_the_batch():
    """64 requests in flight over 16 servers: 4 sequences each, so the bulk decodes ~30x slower per
    token than at the 128 the servers would otherwise hold."""
    model = preset_model_config("Llama-3.1-8B")
    free = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    capped = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6, max_in_flight=64)
    assert capped.batch == pytest.approx(4) and capped.bulk_s > 10 * free.bulk_s
    assert capped.seconds == capped.bulk_s
