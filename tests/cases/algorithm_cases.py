"""One trainer step of every registered algorithm and KL variant, several per spawned process."""

from megatron_zcpo.training.rollout_step import RolloutStep
from tests.cases import trainer_cases

# name -> AlgorithmConfig fields; a KL coefficient large enough that a wrong KL gradient shows.
VARIANTS = {
    "zcpo": {"name": "zcpo"},
    "zcpo-drift-k1": {"name": "zcpo", "drift": "k1"},
    "dapo-kl-none": {"name": "dapo"},
    "dapo-kl-k1": {"name": "dapo", "kl_loss": "k1", "kl_coef": 0.5},
    "grpo-kl-k2": {"name": "grpo", "kl_loss": "k2", "kl_coef": 0.5},
    "grpo-kl-k3-f1c": {"name": "grpo", "kl_coef": 0.5, "f1_control": "match_masked_norm"},
    "grpo-kl-full": {"name": "grpo", "kl_loss": "full", "kl_coef": 0.5},
    "dapo-kl-full-f1b": {"name": "dapo", "kl_loss": "full", "kl_coef": 0.5, "f1_control": "mask_clipped"},
    "rpg": {"name": "rpg"},
    "gvpo": {"name": "gvpo"},
}


def every_variant(rank, world, layouts, policy, reference):
    """{(tp, pp, variant): coefficients, metrics and updated global weights} for each (tp, pp) in
    ``layouts`` (all of world size ``world``), one trainer step each."""
    results = {}
    for tp, pp in layouts:
        for variant, fields in VARIANTS.items():
            fields = dict(fields)
            trainer = trainer_cases.make_trainer(tp, pp, policy, reference, fields.pop("name"), **fields)
            samples = trainer_cases.rollout()
            probe = _reference_probe_norm(trainer, samples) if trainer.algorithm.needs_current_kl else None
            metrics = trainer.train_step(samples)
            results[tp, pp, variant] = {
                "coefficients": trainer.last_coefficients,
                "metrics": metrics,
                "params": trainer.global_state_dict(),
                "probe_norm": probe,
            }
    return results


def _reference_probe_norm(trainer, samples):
    """||grad|| of the first mini-batch's loss through the diagnostics' gradient probe with the
    reference alongside (PolicyWithReference through megatron's schedule and grad finalisation)."""
    plan = trainer.assign_minibatches(samples)
    experience = trainer.experience(samples, plan)
    coefficients, stats = trainer.calibrate(samples, experience)
    vector = trainer.gradient_vector(
        RolloutStep(samples, plan, experience, coefficients, stats),
        plan.mine[0],
        trainer.normalizer(samples, plan.minibatches[0]),
        lambda inputs: trainer.algorithm_loss(inputs).loss,
        use_reference=True,
    )
    return trainer.gradient_dot(vector, vector) ** 0.5
