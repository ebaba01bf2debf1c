"""The RL trainer at PP2 with uneven stages (parallel.first_stage_layers: a 3-layer model as 2 + 1)
gives one process's coefficients, losses and parameters."""

import dataclasses

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases
from tests.training.test_trainer_layouts import _assert_same_step

THREE_LAYERS = dataclasses.replace(trainer_cases.MODEL, num_layers=3)


def _weights_and_single_process_step(rank, world, model):
    """Distinct policy and reference weights of ``model`` and one process's step from them."""
    weights = trainer_cases.weights(21, model), trainer_cases.weights(22, model)
    return weights, trainer_cases.one_update(rank, world, 1, 1, *weights, model=model)


def test_pp2_with_2_plus_1_layers_trains_like_one_process():
    weights, single = run_distributed(_weights_and_single_process_step, 1, THREE_LAYERS)[0]
    uneven = run_distributed(trainer_cases.one_update, 2, 1, 2, *weights, model=THREE_LAYERS, first_stage_layers=2)
    _assert_same_step(uneven, single)
    assert max((single["params"][n] - w).abs().max().item() for n, w in weights[0].items()) > 1e-4
