"""The step-time model against published runs: every row of benchmarks/RESULTS.md's calibration
table within the band, so a change to a constant that breaks calibration fails here."""

from pathlib import Path

import pytest

from megatron_zcpo.convert.presets import preset_model_config
from megatron_zcpo.planning.calibration import BAND, PUBLISHED_RUNS, calibration_table, predict
from megatron_zcpo.planning.decode_rate import (
    INTERNODE_ALLREDUCE_S,
    generation_time,
    internode_allreduce_s,
    served_step_s,
)
from megatron_zcpo.planning.transitions import ipc_push_s


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
    requests, not its KV pool's ~300. The longest 3,900-token response decodes its first 800 steps
    (the bulk's: every request fits) within the batch, then its other 3,100 alone, for tens of
    seconds: the step waits for the bulk and that rest. With 16x the requests the bulk's steps
    outlast the longest response: the bulk alone."""
    model = preset_model_config("Llama-3.1-8B")
    few = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    assert few.batch == pytest.approx(128)
    assert few.tail_s > few.bulk_s and 20 < few.tail_s < 120
    assert few.seconds == pytest.approx(few.bulk_s + few.tail_s * (3900 - 800) / 3900)
    many = generation_time(model, 2048 * 16, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    assert many.batch < 1024 and many.bulk_s > few.bulk_s * 4 and many.seconds == many.bulk_s


def test_the_clients_cap_on_requests_in_flight_bounds_the_batch():
    """64 requests in flight over 16 servers: 4 sequences each, so the bulk decodes ~30x slower per
    token than at the 128 the servers would otherwise hold."""
    model = preset_model_config("Llama-3.1-8B")
    free = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6)
    capped = generation_time(model, 2048, 200, 800, 3900, 16, 1, mem_fraction=0.6, max_in_flight=64)
    assert capped.batch == pytest.approx(4) and capped.bulk_s > 10 * free.bulk_s
    assert capped.seconds == capped.bulk_s


def test_a_server_spanning_nodes_pays_its_collectives_by_the_depth_of_a_tree_over_them():
    """Two collectives per layer and decode step: none within a node, one tree level at two nodes
    (the fitted constant), two at four (DeepSeek-V3's TP32 servers); SGLang's two-batch overlap hides
    them behind the step's own work where that is longer."""
    model = preset_model_config("DeepSeek-V3")
    assert internode_allreduce_s(8, 8) == 0.0 and internode_allreduce_s(16, 8) == INTERNODE_ALLREDUCE_S
    assert internode_allreduce_s(32, 8) == pytest.approx(2 * INTERNODE_ALLREDUCE_S)
    one_node, four_nodes = (served_step_s(model, 64, 700, tp, gpus_per_node=8) for tp in (8, 32))
    collectives = 2 * model.num_layers * 2 * INTERNODE_ALLREDUCE_S
    alone = served_step_s(model, 64, 700, 32, gpus_per_node=32)  # the same server within one node
    assert four_nodes == pytest.approx(alone + collectives) and one_node > alone
    hidden = served_step_s(model, 64, 700, 32, gpus_per_node=8, two_batch_overlap=True)
    assert hidden == pytest.approx(max(alone, collectives))


def test_the_cuda_ipc_push_reproduces_both_published_refits():
    """The colocated push is fitted on NeMo-RL's Llama-3.1-70B (14 s) and DeepSeek-V3 (47.2 s) refits."""
    for preset, seconds in (("Llama-3.1-70B", 14.0), ("DeepSeek-V3", 47.2)):
        assert ipc_push_s(2 * preset_model_config(preset).num_parameters) == pytest.approx(seconds, rel=1e-3)
