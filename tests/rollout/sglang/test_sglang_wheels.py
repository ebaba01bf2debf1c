"""Our launch line, endpoint table and request bodies against SGLang's own code, from the pinned and newest wheels.

The wheels are downloaded without their (CUDA) dependencies into the test cache
(:mod:`megatron_zcpo.testing.real_sglang`): the launch line is parsed by each release's own
``ServerArgs.add_cli_args``; the table of :mod:`megatron_zcpo.rollout.sglang.api` (which the mock
server enforces) is checked field by field against each release's request classes; the bodies the
client sends are checked against 0.5.23's generated JSON contract. Without a registry they skip.
"""

import pytest

from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.sglang.api import (
    ENDPOINTS,
    NEWEST_CHECKED_RELEASE,
    PINNED_RELEASE,
    ROUTED_EXPERTS_RELEASE,
    SAMPLING_FIELDS,
    release_at_least,
)
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.rollout.sglang.server import ServerSpec, SGLangServerConfig, server_command
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.testing.real_sglang import (
    PackageUnavailable,
    generate_contract,
    parse_launch_args,
    request_fields,
    sampling_fields,
    sglang_source,
)
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

# The request class of each body-carrying endpoint (managers/io_struct.py, both releases).
REQUEST_CLASSES = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


@pytest.fixture(scope="module", params=[PINNED_RELEASE, NEWEST_CHECKED_RELEASE])
def release(request):
    try:
        sglang_source(request.param)
    except PackageUnavailable as error:
        pytest.skip(f"the sglang {request.param} wheel could not be downloaded: {error}")
    return request.param


def test_the_launch_line_parses_with_the_releases_own_parser(release):
    routed = release_at_least(release, ROUTED_EXPERTS_RELEASE)
    newest = release == NEWEST_CHECKED_RELEASE
    config = SGLangServerConfig(
        model_path="/models/qwen",
        tp_size=4,
        context_length=4096,
        quantization="modelopt_fp8" if newest else None,
        enable_deterministic_inference=True,
        api_key="k",
        ep_size=4,
        return_routed_experts=routed,
    )
    argv = server_command(ServerSpec("node1", 30000, (0, 1, 2, 3)), config)[3:]  # after python -m module
    keys = ["model_path", "host", "port", "tp_size", "ep_size", "context_length", "quantization", "dtype"]
    keys += ["mem_fraction_static", "random_seed", "enable_deterministic_inference", "attention_backend", "api_key"]
    keys += ["skip_tokenizer_init"]
    aliases = {"tensor_parallel_size": "tp_size", "expert_parallel_size": "ep_size"}  # 0.5.3.post3's dests
    argvs = [argv, argv + ["--enable-return-routed-experts"], argv + ["--quantization", "modelopt_fp8"]]
    try:
        parsed, with_routed, with_fp8 = parse_launch_args(
            release, argvs, keys + list(aliases) + ["enable_return_routed_experts"] * routed
        )
    except PackageUnavailable as error:
        pytest.skip(f"sglang {release}'s parser dependencies could not be installed: {error}")
    assert isinstance(parsed, dict), parsed
    assert {aliases.get(key, key): value for key, value in parsed.items()} == {
        "model_path": "/models/qwen",
        "host": "node1",
        "port": 30000,
        "tp_size": 4,
        "ep_size": 4,
        "context_length": 4096,
        "quantization": "modelopt_fp8" if newest else None,
        "dtype": "bfloat16",
        "mem_fraction_static": 0.85,
        "random_seed": 0,
        "enable_deterministic_inference": True,
        "attention_backend": "fa3",
        "api_key": "k",
        "skip_tokenizer_init": True,
        **({"enable_return_routed_experts": True} if routed else {}),
    }
    # Routing replay needs a newer server (the pinned one refuses the flag); 0.5.3.post3 has no
    # modelopt_fp8 choice (it reads an FP8 checkpoint's format from its hf_quant_config.json).
    assert isinstance(with_routed, dict) == routed and isinstance(with_fp8, dict) == newest
    if not newest:
        assert "unrecognized arguments: --enable-return-routed-experts" in with_routed
        assert "argument --quantization: invalid choice: 'modelopt_fp8'" in with_fp8


def test_every_field_of_the_endpoint_table_is_a_field_of_the_releases_request_class(release):
    for endpoint in ENDPOINTS:
        if release not in endpoint.releases or endpoint.path not in REQUEST_CLASSES:
            continue
        ours = set(endpoint.required) | set(endpoint.optional)
        theirs = request_fields(release, REQUEST_CLASSES[endpoint.path])
        assert ours - theirs <= {"model"}, (endpoint.path, sorted(ours - theirs))  # "model": a router's, ignored
        assert set(endpoint.required) <= theirs
    assert set(SAMPLING_FIELDS) <= sampling_fields(release)


class RecordingServer(MockSGLangServer):
    """The mock server, keeping every /generate body it was sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bodies = []

    async def _generate(self, request):
        self.bodies.append(await request.json())
        return await super()._generate(request)


def test_the_generate_bodies_we_send_pass_the_newest_releases_json_contract():
    try:
        contract = generate_contract(NEWEST_CHECKED_RELEASE)
    except PackageUnavailable as error:
        pytest.skip(f"the sglang {NEWEST_CHECKED_RELEASE} wheel could not be downloaded: {error}")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=3, stop_token_ids=(7,), seed=5)
    with RecordingServer(ScriptedEngine(), release=NEWEST_CHECKED_RELEASE, deterministic_inference=True) as server:
        config = _config(server.url, sampling_seeds=True, return_routed_experts=True)
        with SGLangEngine(config) as engine:
            engine.generate([[1, 2], [3]], params, n=2)
    assert len(server.bodies) == 4
    for body in server.bodies:
        contract.GenerateRequest.from_json_value(body)  # raises JsonContractError on a violation
    with pytest.raises(contract.JsonContractError, match="unknown field `seed`"):
        contract.GenerateRequest.from_json_value({**body, "sampling_params": {"seed": 1}})
