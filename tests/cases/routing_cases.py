"""Routing-replay runs of the tiny Qwen3-MoE trainer (module-level so spawned ranks can import them)."""

import torch

from tests.cases import trainer_cases

MOE = trainer_cases.QWEN3_MOE


class RouterNoise:
    """A diagnostics stand-in that, between calibration and the update, adds noise of size ``scale``
    to every policy router: the update's routers then prefer other experts for many tokens."""

    def __init__(self, scale: float):
        self.scale = scale

    def due(self, step: int) -> bool:
        return True

    def run(self, update, step) -> dict:
        from megatron.core.transformer.moe.router import TopKRouter

        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for module in update.models.policy.modules():
                if isinstance(module, TopKRouter):
                    module.weight.add_(self.scale * torch.randn(module.weight.shape, generator=generator))
        return {}

    def before_minibatch(self, update, step, index) -> dict:
        return {}


def routing_step(rank, world, tp, weights, mode, engine_routing=None, noise=0.0):
    """One step of ``train.routing_replay = mode`` (TP ``tp`` with SP): its metrics, and the routing
    the experience pass recorded or replayed ({sample: int [sequence, layers * k]}, this rank's)."""
    trainer = trainer_cases.make_trainer(
        tp, 1, *weights, model=MOE, sequence_parallel=tp > 1, train_overrides={"routing_replay": mode}
    )
    trainer.diagnostics = RouterNoise(noise) if noise else None
    samples = trainer_cases.rollout()
    for index, routing in (engine_routing or {}).items():
        samples[index].routed_experts = routing
    metrics = trainer.train_step(samples)
    step = trainer.routing.step
    recorded = {i: r.reshape(r.shape[0], -1).int() for i, r in (step.reference or step.engine).items()}
    return {"metrics": metrics, "routing": recorded if tp == 1 or rank == 0 else None}


def engine_completions(rank, world, weights, prompts):
    """The embedded engine's completions (with routed experts) of ``prompts`` at the policy weights,
    directly and through the mock SGLang server of the newest checked release (the client decodes)."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
    from megatron_zcpo.testing.mock_server import MockSGLangServer

    setup_megatron()
    engine = EmbeddedEngine(MOE, seed=1, record_routed_experts=True)
    engine.update_weights(megatron_to_hf_stream(weights[0].items(), MOE), version=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    direct = engine.generate(prompts, params, n=2)
    served = {}
    for release in (NEWEST_CHECKED_RELEASE, PINNED_RELEASE):
        with MockSGLangServer(engine, release=release) as server:
            client = SGLangEngine(
                SGLangEngineConfig(server_urls=[server.url], return_routed_experts=True, max_retries=0)
            )
            try:
                served[release] = client.generate(prompts, params, n=2)
            except Exception as error:
                served[release] = str(error)
            client.shutdown()
    return direct, served
