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
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
}


@pytest.fixture(scope="module", params=[PINNED_RELEASE, NEWEST_CHECKED_RELEASE])
def release(request):
    try:
        sglang_source(request.param)
    except PackageUnavailable as error:
        pytest.skip(f"the sglang {request.param} wheel could not be downloaded: {error}")
    return request.param


ALIASES = {"tensor_parallel_size": "tp_size", "expert_parallel_size": "ep_size", "data_parallel_size": "dp_size"}
KEYS = ["model_path", "host", "port", "tp_size", "ep_size", "context_length", "quantization", "dtype"]
KEYS += ["mem_fraction_static", "random_seed", "enable_deterministic_inference", "attention_backend", "api_key"]
KEYS += ["dp_size", "enable_dp_attention", "trust_remote_code", "nnodes", "node_rank", "dist_init_addr"]
KEYS += ["enable_lora", "max_lora_rank", "lora_target_modules", "enable_memory_saver", "enable_weights_cpu_backup"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _qwen_launch(release):
    return SGLangServerConfig(
        model_path="/models/qwen",
        tp_size=4,
        context_length=4096,
        quantization="modelopt_fp8" if release == NEWEST_CHECKED_RELEASE else None,
        enable_deterministic_inference=True,
        api_key="k",
        ep_size=4,
        return_routed_experts=release_at_least(release, ROUTED_EXPERTS_RELEASE),
        lora_rank=16,
        lora_target_modules=LORA_TARGETS,
        enable_memory_saver=True,  # colocated, FP8: the weights' host copy keeps the activation scales
        enable_weights_cpu_backup=True,
    )


# DeepSeek-V3 at TP32 on 8-GPU nodes: 2 servers of 4 nodes each (their first node serves HTTP),
# experts over the 32 ranks, attention data-parallel in 4 groups, the fa3 backend, remote code.
DEEPSEEK_LAUNCH = SGLangServerConfig(
    model_path="/models/dsv3",
    tp_size=32,
    ep_size=32,
    dp_attention=4,
    attention_backend="fa3",
    trust_remote_code=True,
    nodes=[f"n{i}" for i in range(8)],
    gpus_per_node=8,
    api_key="k",
)


@pytest.fixture(scope="module")
def parsed_launches(release):
    """Every launch line of this file parsed by the release's own parser, in one subprocess: the
    Qwen line (plain, with routed experts, with modelopt_fp8) and the 4 nodes of a DeepSeek-V3 server."""
    from megatron_zcpo.rollout.sglang.server import server_specs

    argv = server_command(ServerSpec("node1", 30000, (0, 1, 2, 3)), _qwen_launch(release))[3:]  # after python -m module
    spanning = server_specs(DEEPSEEK_LAUNCH, env={})[1]
    argvs = [argv, argv + ["--enable-return-routed-experts"], argv + ["--quantization", "modelopt_fp8"]]
    argvs += [server_command(spanning, DEEPSEEK_LAUNCH, node_rank=rank)[3:] for rank in range(4)]
    routed = ["enable_return_routed_experts"] * release_at_least(release, ROUTED_EXPERTS_RELEASE)
    try:
        answers = parse_launch_args(release, argvs, KEYS + list(ALIASES) + routed)
    except PackageUnavailable as error:
        pytest.skip(f"sglang {release}'s parser dependencies could not be installed: {error}")
    return [{ALIASES.get(k, k): v for k, v in a.items()} if isinstance(a, dict) else a for a in answers]


def test_the_launch_line_parses_with_the_releases_own_parser(release, parsed_launches):
    routed = release_at_least(release, ROUTED_EXPERTS_RELEASE)
    newest = release == NEWEST_CHECKED_RELEASE
    parsed, with_routed, with_fp8 = parsed_launches[:3]
    assert isinstance(parsed, dict), parsed
    assert parsed == {
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
        "dp_size": 1,
        "enable_dp_attention": False,
        "trust_remote_code": False,
        "nnodes": 1,
        "node_rank": 0,
        "dist_init_addr": None,
        "enable_lora": True,
        "max_lora_rank": 16,
        "lora_target_modules": LORA_TARGETS,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        **({"enable_return_routed_experts": True} if routed else {}),
    }
    # Routing replay needs a newer server (the pinned one refuses the flag); 0.5.3.post3 has no
    # modelopt_fp8 choice (it reads an FP8 checkpoint's format from its hf_quant_config.json).
    assert isinstance(with_routed, dict) == routed and isinstance(with_fp8, dict) == newest
    if not newest:
        assert "unrecognized arguments: --enable-return-routed-experts" in with_routed
        assert "argument --quantization: invalid choice: 'modelopt_fp8'" in with_fp8


def test_deepseek_v3_servers_spanning_nodes_parse_with_the_releases_own_parser(parsed_launches):
    from megatron_zcpo.rollout.sglang.server import server_specs

    specs = server_specs(DEEPSEEK_LAUNCH, env={})
    assert [(s.url, s.nodes) for s in specs] == [
        ("http://n0:30000", ("n0", "n1", "n2", "n3")),
        ("http://n4:30000", ("n4", "n5", "n6", "n7")),
    ]
    for rank, answer in enumerate(parsed_launches[3:]):
        assert isinstance(answer, dict), answer
        expected = dict(tp_size=32, ep_size=32, dp_size=4, enable_dp_attention=True, attention_backend="fa3")
        expected.update(trust_remote_code=True, nnodes=4, node_rank=rank, dist_init_addr="n4:29700")
        assert {key: answer[key] for key in expected} == expected


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
    contract.GenerateRequest.from_json_value({**body, "lora_path": "zcpo-lora-v3"})  # model.lora.push=adapter
    with pytest.raises(contract.JsonContractError, match="unknown field `seed`"):
        contract.GenerateRequest.from_json_value({**body, "sampling_params": {"seed": 1}})


# Where each release's DeepSeek-V3 loader lives, and the lines the weight push's bucketing relies on
# (megatron_zcpo/convert/deepseek.py, sglang_load_partner): the q_a_proj / kv_a_proj_with_mqa cache
# is local to one load_weights call, and that call rebuilds w_kc / w_vc of the kv_b_proj it loaded.
DEEPSEEK_LOADERS = {
    PINNED_RELEASE: "sglang/srt/models/deepseek_v2.py",
    NEWEST_CHECKED_RELEASE: "sglang/srt/models/deepseek_common/deepseek_weight_loader.py",
}


def test_the_deepseek_loader_fuses_the_query_and_key_latents_within_one_call(release):
    source = (sglang_source(release) / DEEPSEEK_LOADERS[release]).read_text()
    assert "cached_a_proj = {} if fuse_qkv_a_proj else None" in source
    assert '"fused_qkv_a_proj_with_mqa"' in source
    assert "self.post_load_weights(is_nextn=is_nextn, weight_names=weight_names)" in source
    assert 'if "kv_b_proj" in name:' in source  # post_load_weights: the layers whose kv_b_proj came
