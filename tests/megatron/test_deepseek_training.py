"""DeepSeek-V3 training through megatron-core's MLA and MoE layers (tiny, CPU): TP2+SP x PP2 (uneven) x EP2
(bias frozen) and DP4 x EP2 (bias moved by DeepSeek's aux-free rule) equal one process, exact resume at EP2
with the moving bias, routing replay R2/R3 with the sigmoid router and its correction bias, the bias frozen
by default and moved by the rule when asked."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import deepseek_cases
from tests.training.test_trainer_layouts import _assert_same_step

BIAS_RATE = 0.01
BIASES = [deepseek_cases.BIAS.format(layer) for layer in (1, 2)]  # layer 0 is dense


@pytest.fixture(scope="module")
def single():
    return run_distributed(deepseek_cases.in_one_process, 1, BIAS_RATE)[0]


@pytest.fixture(scope="module")
def weights(single):
    return single["weights"]


def test_the_reference_step_trains_attention_experts_and_router_not_the_bias(single, weights):
    reference, initial = single["reference"], weights[0]
    assert reference["metrics"]["experience/kl"] > 1e-3
    for name in (
        "decoder.layers.1.self_attention.linear_kv_up_proj.weight",
        "decoder.layers.2.self_attention.q_layernorm.weight",
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight",
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight",
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
    ):
        assert (reference["params"][name] - initial[name]).abs().max() > 1e-5, name
    for name in BIASES:  # train.moe.expert_bias_update_rate 0: frozen, bit for bit
        assert reference["params"][name].dtype == torch.float32
        assert torch.equal(reference["params"][name], initial[name]), name


def test_the_aux_free_rule_moves_each_bias_by_the_rate(single, weights):
    """Two optimizer steps (two mini-batches) at rate 0.01: every bias moved by a multiple of 0.01,
    at most 0.02, towards the mean load, not all by zero."""
    for name in BIASES:
        moved = single["balanced"]["params"][name] - weights[0][name]
        steps = moved / BIAS_RATE
        torch.testing.assert_close(steps, steps.round(), atol=1e-3, rtol=0)
        assert steps.abs().max() <= 2 + 1e-3 and steps.abs().max() >= 1 - 1e-3, name


@pytest.fixture(scope="module")
def four_ranks(weights, tmp_path_factory):
    """One spawn of 4 ranks for every multi-rank layout (deepseek_cases.four_ranks)."""
    return run_distributed(deepseek_cases.four_ranks, 4, weights, str(tmp_path_factory.mktemp("ep2_resume")), BIAS_RATE)


def test_tp2_sp_pp2_uneven_ep2_matches_one_process(single, four_ranks):
    """4 ranks: TP2 with sequence parallelism, PP2 with 1 + 2 layers, EP2 with the experts over the TP ranks."""
    _assert_same_step([r["layout"] for r in four_ranks], single["reference"])


def test_ep2_dp4_matches_one_process_and_resumes_exactly(single, weights, four_ranks):
    """Four data-parallel replicas, each rank half the experts, the correction bias moved by the aux-free
    rule after every optimizer step (two per training step): the first step (biases included) equals one
    process's, so each move used every rank's token counts; the second step after a checkpoint and a
    resume (a fresh trainer) equals the uninterrupted second step (experts, their distributed-optimizer
    state, the moved biases: the only state the rule keeps, its token counts restart at every step)."""
    _assert_same_step([r["first"] for r in four_ranks], single["balanced"])
    for name in BIASES:  # the rule did move them, so the equalities above are about the moved values
        assert not torch.equal(four_ranks[0]["first"]["params"][name], weights[0][name]), name
        moved = four_ranks[0]["uninterrupted"]["params"][name] - four_ranks[0]["first"]["params"][name]
        assert moved.abs().max() >= BIAS_RATE - 1e-6, name  # and moved again in step 2
    for result in four_ranks:
        resumed, uninterrupted = result["resumed"], result["uninterrupted"]
        assert resumed["step"] == 2
        assert resumed["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-6)
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0, msg=name)


def test_r2_routes_the_update_as_the_experience_pass_recorded(single):
    metrics = single["replayed"]["experience"]["metrics"]
    assert metrics["routing/update_pair_mismatch"] == 0.0
    assert metrics["routing/update_router_drift"] > 0.1  # the perturbed sigmoid router would choose otherwise
    routing = single["replayed"]["experience"]["routing"]
    assert all(r.shape[1] == 2 * 4 and r.min() >= 0 and r.max() < 8 for r in routing.values())  # 2 MoE layers x top-4


def test_r3_replays_the_engine_routing(single):
    """The engine's routing with every third token's experts moved: the experience pass finds that
    share, and both passes route by the engine's experts."""
    metrics = single["replayed"]["rollout"]["metrics"]
    engine = [r for r in single["replayed"]["rollout"]["engine"] if r is not None]
    flipped = sum(int((torch.arange(r.shape[0]) % 3 == 0).sum()) for r in engine)
    total = sum(r.shape[0] for r in engine)
    assert metrics["routing/rollout_token_mismatch"] == pytest.approx(flipped / total, abs=0.02)
    assert metrics["routing/update_pair_mismatch"] == 0.0


def test_the_weight_push_keeps_what_sglang_fuses_in_one_bucket(single):
    """SGLang's DeepSeek-V3 loader fuses q_a_proj with kv_a_proj_with_mqa within one load_weights call
    (one bucket): at every bucket size, in the push's own order and dtypes (bf16, the correction bias
    float32), each pair shares a bucket in both transports' bucketings (NCCL broadcast, CUDA IPC);
    without the pairing small buckets split them."""
    from megatron_zcpo.convert.deepseek import sglang_load_partner
    from megatron_zcpo.megatron.weights import bucket_tensors
    from megatron_zcpo.rollout.sglang.update_weight.distributed import push_buckets
    from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import flattened_buckets

    def dtype(name):
        return torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16

    stream = [(name, torch.zeros(shape, dtype=dtype(name))) for name, shape in single["push_order"]]
    pairs = {name: sglang_load_partner(name) for name, _ in stream if sglang_load_partner(name)}
    assert len(pairs) == 3 and all(partner in dict(stream) for partner in pairs.values())  # one per layer

    def split_pairs(buckets):
        where = {name: i for i, bucket in enumerate(buckets) for name in bucket}
        return [name for name, partner in pairs.items() if where[name] != where[partner]]

    for size in (1, 4096, 20_000, 2**30):
        assert not split_pairs([[n for n, _ in b] for b in push_buckets(stream, size)])
        assert not split_pairs([[m.name for m in meta] for _, meta in flattened_buckets(stream, size, "cpu")])
    assert split_pairs([[n for n, _ in b] for b in bucket_tensors(stream, 1)])  # what the pairing prevents
