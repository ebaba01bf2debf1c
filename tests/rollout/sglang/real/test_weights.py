"""Every weight transport a CPU carries, into the real SGLang 0.5.3.post3 and 0.5.23: disk, tensor (CPU tensors
shared as files) and distributed over gloo (0.5.23: inside begin/end weight-update sessions, flattened
buckets). Each push is held against SGLang's own loader: the greedy output and log-probs after it equal those
after loading the same weights from disk, they differ from before, and the server reports the pushed version."""

import pytest
import torch

from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
from megatron_zcpo.rollout.engine import RolloutError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[5, 6, 7], [20, 30, 40, 50], [100, 3, 9, 250, 17]]


def other_weights(model_dir, seed: int):
    """A fresh random initialisation of the served model (its Hugging Face names and shapes), by ``seed``, ten
    times the usual scale: at 0.02 a tiny model with tied embeddings repeats the prompt's last token whatever
    the seed, at 0.2 each seed's greedy outputs are its own."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    return {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}  # tied


@pytest.fixture
def served(real_server, model_dir, tmp_path):
    """(greedy outputs of the model's own weights, loaded first from disk as version 0; a disk-transport client)."""
    with SafetensorsCheckpoint(str(model_dir)) as checkpoint:
        original = {name: checkpoint.tensor(name) for name in checkpoint.names()}
    with real_server.engine(weight_sync="disk", weight_dir=str(tmp_path / "disk"), max_concurrency=1) as disk:
        disk.update_weights(original.items(), 0)  # whatever an earlier test left on the shared server
        yield disk.generate(PROMPTS, GREEDY), disk


def outputs(groups):
    return [(c.output_ids, c.output_logprobs) for [c] in groups]


def assert_same_outputs(pushed, loaded):
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(outputs(pushed), outputs(loaded)):
        assert ids == ref_ids
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-3)


def test_disk_push_and_back(served, model_dir):
    before, disk = served
    weights = other_weights(model_dir, seed=1)
    disk.update_weights(weights.items(), 11)
    assert disk.weight_version() == 11
    pushed = disk.generate(PROMPTS, GREEDY)
    assert [c.output_ids for [c] in pushed] != [c.output_ids for [c] in before]
    assert all(c.weight_version == 11 for [c] in pushed)


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_push_equals_sglangs_own_load(served, real_server, release, model_dir, transport):
    before, disk = served
    weights = other_weights(model_dir, seed={"tensor": 2, "distributed": 3}[transport])
    client = {"tensor": {}, "distributed": {"group_backend": "gloo", "master_address": "127.0.0.1"}}[transport]
    flattened = transport == "distributed" and release != "0.5.3.post3"
    with real_server.engine(
        weight_sync=transport, bucket_bytes=2**18, flattened_buckets=flattened, max_concurrency=1, **client
    ) as engine:
        if transport == "distributed" and release == "0.5.3.post3":
            # 0.5.3.post3 passes pg_options to a torch 2.8 helper; the CPU venv's torch 2.13 has no such argument
            with pytest.raises(RolloutError, match="refused the weight-update group.*pg_options"):
                engine.update_weights(weights.items(), 21)
            assert engine.weight_version() == 0 and outputs(engine.generate(PROMPTS, GREEDY)) == outputs(before)
            return
        engine.update_weights(weights.items(), 21)
        assert engine.pushed["buckets"] > 1 and engine.weight_version() == 21
        pushed = engine.generate(PROMPTS, GREEDY)
    assert [c.output_ids for [c] in pushed] != [c.output_ids for [c] in before]
    assert all(c.weight_version == 21 for [c] in pushed)
    disk.update_weights(weights.items(), 22)
    assert_same_outputs(pushed, disk.generate(PROMPTS, GREEDY))
