"""The LoRA adapter push (model.lora.push=adapter) through the client into the SGLang double of both releases:
a name per version, the old one unloaded, requests naming the current one, SGLang's refusals and start-up checks."""

import json
import os
import urllib.error
import urllib.request

import pytest
import torch

from megatron_zcpo.convert.peft import hf_target_modules, peft_adapter_config
from megatron_zcpo.megatron.lora import LoraConfig
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.embedded import EmbeddedEngine
from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, RELEASES
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

MODEL = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4)
LORA = LoraConfig(rank=4, alpha=8.0, push="adapter")
MODULES = hf_target_modules(LORA)


def _embedded():
    """An embedded engine holding the same seeded base weights every time."""
    engine = EmbeddedEngine(MODEL, seed=3)
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(t.shape, generator=generator) * 0.2 for name, t in engine.model.state_dict().items()}
    engine.update_weights(weights.items(), 0)  # every weight loaded once
    return engine


def _adapter(seed):
    """Random PEFT tensors of LORA on MODEL: {key: tensor} (B != 0)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in _embedded().model.state_dict().items():
        module = name.rsplit(".", 2)[-2]
        if module in MODULES and name.endswith(".weight"):
            key = "base_model.model." + name[: -len(".weight")]
            tensors[key + ".lora_A.weight"] = torch.randn(LORA.rank, weight.shape[1], generator=generator) * 0.3
            tensors[key + ".lora_B.weight"] = torch.randn(weight.shape[0], LORA.rank, generator=generator) * 0.3
    return tensors


def _merged_engine(tensors):
    """An embedded engine holding W + (alpha/r) B A: what a server serving the adapter computes."""
    engine = _embedded()
    merged = {}
    for name, weight in engine.model.state_dict().items():
        key = "base_model.model." + name[: -len(".weight")]
        if key + ".lora_A.weight" in tensors:
            delta = tensors[key + ".lora_B.weight"] @ tensors[key + ".lora_A.weight"]
            merged[name] = weight + LORA.scaling * delta
    engine.update_weights(merged.items(), 0)
    return engine


def _lora_server(release, **options):
    return MockSGLangServer(
        _embedded(),
        release=release,
        deterministic_inference=True,
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules=MODULES,
        **options,
    )


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=11)


@pytest.mark.parametrize("release", RELEASES)
def test_each_version_is_served_under_its_own_name_and_the_old_one_unloaded(release, tmp_path):
    first, second = _adapter(1), _adapter(2)
    with _lora_server(release) as server:
        config = _config(server.url, weight_dir=str(tmp_path), sampling_seeds=True)
        with SGLangEngine(config) as engine:
            engine.check_servers(8, 4, LORA)
            written = engine.update_adapter(first.items(), peft_adapter_config(LORA), version=1)
            [name_1] = server.loaded_adapters
            assert server.loaded_adapters[name_1] == str(tmp_path / "lora-v1") and name_1.endswith("-v1")
            [[sample]] = engine.generate([[5, 6, 7]], PARAMS)
            engine.update_adapter(second.items(), peft_adapter_config(LORA), version=2)
            [[later]] = engine.generate([[5, 6, 7]], PARAMS)
            assert engine.weight_version() == 2
        [name_2] = server.loaded_adapters  # the old one is unloaded
        assert server.loaded_adapters[name_2] == str(tmp_path / "lora-v2") and name_2.endswith("-v2")
        assert sorted(os.listdir(tmp_path)) == ["lora-v2"]  # the old version's folder is gone
        assert server.lora_requests == [name_1, name_2]
        # A restarted trainer (a new client) pushes version 2 again: its own name, the old process's unloaded.
        with SGLangEngine(config) as again:
            again.update_adapter(second.items(), peft_adapter_config(LORA), version=2)
        [name_3] = server.loaded_adapters
        assert name_3 != name_2 and name_3.endswith("-v2")
    assert written == sum(t.numel() * t.element_size() for t in first.values())
    assert (sample.weight_version, later.weight_version) == (1, 2)
    # The server generated with the adapter: as an engine holding the merged weights does.
    for completion, tensors in ((sample, first), (later, second)):
        [[expected]] = _merged_engine(tensors).generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, seed=11))
        assert completion.output_ids == expected.output_ids
        assert completion.output_logprobs == pytest.approx(expected.output_logprobs, abs=1e-5)


@pytest.mark.parametrize("release", RELEASES)
def test_lora_requests_are_refused_as_each_release_refuses_them(release, tmp_path):
    from megatron_zcpo.convert.peft import write_peft_adapter

    write_peft_adapter(tmp_path / "a", _adapter(1).items(), peft_adapter_config(LORA))
    big = LoraConfig(rank=16, alpha=16.0)
    write_peft_adapter(tmp_path / "big", [], peft_adapter_config(big))
    load = {"lora_name": "a", "lora_path": str(tmp_path / "a")}
    with _lora_server(release) as server:
        assert _post(server.url + "/load_lora_adapter", load)[0] == 200
        status, answer = _post(server.url + "/load_lora_adapter", load)
        assert (status, answer["success"]) == (400, False)
        assert "Failed to load LoRA adapter a because it is already loaded" in answer["error_message"]
        status, answer = _post(
            server.url + "/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path / "big")}
        )
        assert status == 400 and "incompatible with the current LoRA memory pool" in answer["error_message"]
        assert _post(server.url + "/unload_lora_adapter", {"lora_name": "a"})[0] == 200
        status, answer = _post(server.url + "/unload_lora_adapter", {"lora_name": "a"})
        assert status == 400 and "LoRA with name a does not exist" in answer["error_message"]
        status, _ = _post(server.url + "/generate", {"input_ids": [5, 6], "lora_path": "never"})
        assert status == 400
        # 0.5.3.post3 refuses an unloaded adapter; 0.5.23 reloads one it had loaded before, from its path.
        status, _ = _post(server.url + "/generate", {"input_ids": [5, 6], "lora_path": "a"})
        assert status == (200 if release == NEWEST_CHECKED_RELEASE else 400)
        status, _ = _post(server.url + "/load_lora_adapter_from_tensors", {"lora_name": "t"})
        assert status == (400 if release == NEWEST_CHECKED_RELEASE else 404)  # 0.5.23's endpoint, fields missing
    with MockSGLangServer(ScriptedEngine(), release=release) as plain:
        status, answer = _post(plain.url + "/load_lora_adapter", load)
        assert status == 400 and "LoRA is not enabled" in answer["error_message"]


def test_the_start_up_check_names_the_lora_launch_flags(tmp_path):
    """push: adapter needs LoRA serving of the adapter's rank and modules; a whole or merged push needs a
    server without it, which passes over the weights of the projections it adapts."""
    merged = LoraConfig(rank=4, alpha=8.0)
    with MockSGLangServer(ScriptedEngine()) as plain, _lora_server(RELEASES[0]) as lora:
        with SGLangEngine(_config(plain.url)) as engine:
            engine.check_servers(8, 4, merged)
            with pytest.raises(RolloutError, match="--enable-lora --max-lora-rank 4 --lora-target-modules q_proj"):
                engine.check_servers(8, 4, LORA)
        with SGLangEngine(_config(lora.url, sampling_seeds=True)) as engine:
            with pytest.raises(RolloutError, match="launched with --enable-lora: SGLang renames the projections"):
                engine.check_servers(8, 4, merged)
            with pytest.raises(RolloutError, match="up to rank 8 .* needs rank 16"):
                engine.check_servers(8, 4, LoraConfig(rank=16, alpha=16.0, push="adapter"))
        # What the check guards against: the double, like SGLang, keeps an adapted projection through a push.
        before = {k: v.clone() for k, v in lora.backend.model.state_dict().items()}
        pushed = {name: tensor + 1 for name, tensor in before.items() if name.endswith("q_proj.weight")}
        with SGLangEngine(_config(lora.url, weight_sync="disk", weight_dir=str(tmp_path), sampling_seeds=True)) as e:
            e.update_weights(pushed.items(), version=1)
        assert all(torch.equal(lora.backend.model.state_dict()[name], before[name]) for name in pushed)
