"""Every example's train.sbatch at its shipped shape (up to 24 nodes of 8 GPUs, which the one-machine
Slurm of test_example_jobs_slurm.py cannot host), step by step under a stand-in for srun that holds
real Slurm's differences (tests/cli/slurm_standins/srun.py): the server plan, the start-up checks of
the dry run, the SGLang servers and router (the repository's mock server on the tiny model, on loopback
addresses as the nodes), the health wait, and the training step, recorded: its tasks' variables are
checked against what the ranks derive from them (the job's layout on its training GPUs). The job runs
as if submitted with ``--ntasks-per-node=8`` (the job's task counts, which srun would pass on to every
step that does not name its own), with Slurm's compressed node list.
"""

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zcpo.checkpoint.io import write_model_config
from megatron_zcpo.megatron.initialize import distributed_env_from_slurm, job_master_port
from megatron_zcpo.recipe.config import load_run_config
from megatron_zcpo.utils import slurm
from tests.cli.test_examples import MODELS, sbatch_settings
from tests.cli.test_train import tiny_model  # noqa: F401 - the fixture is used by name

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).resolve().parent / "slurm_standins"
REWARD = "megatron_zcpo.rewards.math:dapo_math_reward"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def slurm_bin(tmp_path: Path) -> Path:
    """srun, scontrol and the SGLang interpreter stand-ins, first on the job's PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": f'#!/bin/bash\nexec {sys.executable} {STAND_INS / "srun.py"} "$@"\n',
        "sglang-python": f'#!/bin/bash\nexec {sys.executable} {STAND_INS / "sglang_python.py"} "$@"\n',
        # scontrol: `show hostnames LIST` one host a line (Slurm's expansion of a compressed list);
        # `requeue ID` is recorded.
        "scontrol": '#!/bin/bash\nif [[ "$1 $2" == "show hostnames" ]]; then '
        f"{sys.executable} -c 'import sys; from megatron_zcpo.utils.slurm import parse_slurm_nodelist; "
        'print(*parse_slurm_nodelist(sys.argv[1]), sep=chr(10))\' "$3"; '
        'else echo "$*" >> "${FAKE_SRUN_LOG}.scontrol"; fi\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_job(example: str, tmp_path: Path, model_dir: Path, nodes: int, args=(), **env_changes):
    """Run ``examples/<example>/train.sbatch ARGS`` in an allocation of ``nodes`` loopback "nodes"; the
    finished process, the nodes and the srun steps it issued."""
    bin_dir = slurm_bin(tmp_path)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    subnet = f"127.{random.randrange(1, 255)}.{random.randrange(1, 255)}"  # other runs on this machine
    hosts = [f"{subnet}.{n}" for n in range(1, nodes + 1)]
    log = tmp_path / "srun.jsonl"
    env = dict(  # only what Slurm and the user set: nothing else from this environment leaks in
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        HOME=os.environ.get("HOME", str(tmp_path)),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        SLURM_JOB_ID=str(random.randrange(1000, 10**6)),
        SLURM_JOB_NODELIST=f"{subnet}.[1-{nodes}]" if nodes > 1 else hosts[0],
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(8 * nodes),  # sbatch --ntasks-per-node=8
        SLURM_NTASKS_PER_NODE="8",
        SLURM_TASKS_PER_NODE=f"8(x{nodes})" if nodes > 1 else "8",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_ON_NODE="16",
        SLURM_SUBMIT_DIR=str(ROOT),
        HF_MODEL=str(model_dir),
        MEGATRON_CKPT=str(tmp_path / "ckpt"),
        RUN_DIR=str(tmp_path / "run"),
        TRAIN_DATA=str(model_dir / "train.jsonl"),
        EVAL_DATA=f"{model_dir / 'eval.jsonl'},{model_dir / 'eval.jsonl'}",
        VENV=str(tmp_path / "venv"),
        SGLANG_PYTHON=str(bin_dir / "sglang-python"),
        SGLANG_STARTUP_TIMEOUT="120",
        SGLANG_HEALTH_POLL_S="0.5",
        FAKE_SRUN_LOG=str(log),
    )
    env.update(env_changes)
    done = subprocess.run(
        ["bash", f"examples/{example}/train.sbatch", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, hosts, steps


def converted_checkpoint(tmp_path: Path, example: str, model_dir: Path) -> None:
    """A converted checkpoint of the example's real architecture (what the checks read) with the tiny
    model's tokenizer, as tools/convert_hf_to_megatron.py leaves it (its hf/ holds the tokenizer)."""
    write_model_config(tmp_path / "ckpt", MODELS[example])
    (tmp_path / "ckpt" / "hf").mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tmp_path / "ckpt" / "hf" / name)


def job_output(done, tmp_path: Path) -> str:
    """The job's output and its SGLang step's logs (for a failing assertion)."""
    logs = sorted((tmp_path / "run").glob("sglang*/**/*")) + sorted((tmp_path / "run").glob("sglang_step.log"))
    texts = [f"--- {path.name}\n{path.read_text()[-3000:]}" for path in logs if path.is_file()]
    return "\n".join([done.stdout[-3000:], done.stderr[-5000:], *texts])


def step_named(steps, words):
    found = [step for step in steps if all(word in " ".join(step["command"]) for word in words)]
    assert len(found) == 1, [step["command"][:4] for step in steps]
    return found[0]


@pytest.mark.parametrize("example", sorted(MODELS))
def test_the_job_as_shipped_reaches_training_with_every_check_passed(example, tmp_path, tiny_model, monkeypatch):
    """One rollout node (sbatch --nodes=TRAIN_NODES+1; colocated: the training nodes): its servers are what
    the job starts on each."""
    settings = sbatch_settings(example)
    train_nodes = int(settings["TRAIN_NODES"])
    colocated = settings.get("PLACEMENT") == "colocated"
    nodes_per_server = max(1, int(settings["ROLLOUT_TP"]) // 8)  # DeepSeek-V3's servers span 4 nodes
    converted_checkpoint(tmp_path, example, tiny_model)
    extra = {"REWARD_FUNCTION": REWARD} if "long-context" in example else {}
    done, hosts, steps = run_job(
        example,
        tmp_path,
        tiny_model,
        train_nodes if colocated else train_nodes + nodes_per_server,
        ["train.steps=3"],
        FAKE_SRUN_TRAINING="record",
        ZCPO_OVERRIDES="train.seed=7",
        **extra,
    )
    assert done.returncode == 0, job_output(done, tmp_path)
    assert not [step for step in steps if "convert_hf_to_megatron.py" in " ".join(step["command"])]
    probe = step_named(steps, ["sglang_node.py", "--print"])
    dry_run = step_named(steps, ["zcpo", "--dry-run"])
    servers = step_named(steps, ["sglang_node.py", "--run-config"])
    train = [step for step in steps if step["command"][:2] == ["zcpo", "train"] and step is not dry_run]
    assert len(steps) == 4 and len(train) == 1, [step["command"][:4] for step in steps]
    train = train[0]
    # the one-task steps: Slurm's view of them is one task, the dry run checks the training world anyway
    for step in (probe, dry_run):
        assert [task["SLURM_NTASKS"] for task in step["tasks"]] == ["1"]
        assert step["tasks"][0]["SLURM_JOB_NUM_NODES"] == str(len(hosts))
    rollout_hosts = hosts if colocated else hosts[train_nodes:]
    servers_per_node = max(1, 8 // int(settings["ROLLOUT_TP"]))  # per first node of a server
    assert dry_run["tasks"][0]["SLURMD_NODENAME"] == hosts[0]
    train_gpus = train_nodes * 8
    assert train["command"][:3] == ["zcpo", "train", f"examples/{example}/config.yaml"]
    assert dry_run["command"] == train["command"] + ["--dry-run", "--nproc", str(train_gpus)]
    # what the training tasks receive: the example's config pointing at the servers just started
    config = load_run_config(train["command"][2], train["command"][3:])
    assert config.model.path == str(tmp_path / "ckpt")
    assert config.rollout.sglang.server_urls == [
        f"http://{host}:{30000 + 10 * server}"
        for host in rollout_hosts[::nodes_per_server]
        for server in range(servers_per_node)
    ]
    assert config.rollout.sglang.router_url == f"http://{rollout_hosts[0]}:29000"
    assert config.rollout.placement == ("colocated" if colocated else "disaggregated")
    assert config.data.train_files == [str(tiny_model / "train.jsonl")]
    assert config.eval.data.train_files == [str(tiny_model / "eval.jsonl")] * 2
    assert (config.train.steps, config.train.seed) == (3, 7)  # the job's arguments, then ZCPO_OVERRIDES
    assert config.reward.function == extra.get("REWARD_FUNCTION", config.reward.function)
    parallel = config.parallel
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    layout = f"TP{parallel.tensor} PP{parallel.pipeline} CP{parallel.context} EP{parallel.expert}"
    assert f"valid on {train_gpus} processes: {layout} DP{train_gpus // model_parallel}" in done.stderr
    resolved = load_run_config(str(tmp_path / "run" / "config.resolved.yaml"))
    assert resolved.rollout.sglang.server_urls == config.rollout.sglang.server_urls
    # the SGLang step: one task per rollout node, on it; every server and the router answered
    assert [task["SLURMD_NODENAME"] for task in servers["tasks"]] == rollout_hosts
    assert f"SGLang: {len(rollout_hosts) // nodes_per_server * servers_per_node + 1} endpoints healthy" in done.stdout
    # colocated: both steps share the GPUs (srun --overlap)
    assert ("overlap" in servers["options"], "overlap" in train["options"]) == (colocated, colocated)
    key = servers["env"]["ZCPO_SGLANG_API_KEY"]  # one fresh key per job, for the servers and the trainer
    assert re.fullmatch(r"[0-9a-f]{64}", key) and train["env"]["ZCPO_SGLANG_API_KEY"] == key
    assert train["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # the training step: what every task derives from Slurm's variables is its place in the job's world
    # (each task expands the one node list with `scontrol show hostnames`: here once, not once per task of
    # up to 512, 0.1 s each)
    monkeypatch.setattr(slurm, "expand_slurm_nodelist", functools.cache(slurm.expand_slurm_nodelist))
    derived = []
    for task in train["tasks"]:
        environ = {key: value for key, value in {**task, **train["env"]}.items() if value is not None}
        assert distributed_env_from_slurm(environ)
        derived.append((environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"], environ["MASTER_ADDR"]))
    assert derived == [(str(rank), str(train_gpus), str(rank % 8), hosts[0]) for rank in range(train_gpus)]
    port = int(environ["MASTER_PORT"])  # from the job id: never the router's 29000 or a server's 30000+
    assert port == job_master_port(int(train["job_id"])) and 20000 <= port < 29000
    assert [task["SLURMD_NODENAME"] for task in train["tasks"]] == [hosts[rank // 8] for rank in range(train_gpus)]


def test_the_70b_job_attaches_to_running_servers_with_every_node_training(tmp_path, tiny_model):
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from tests.rollout.sglang.test_sglang_client import ScriptedEngine

    converted_checkpoint(tmp_path, "llama-3.3-70b-zcpo", tiny_model)
    with MockSGLangServer(ScriptedEngine()) as first, MockSGLangServer(ScriptedEngine()) as second:
        done, hosts, steps = run_job(
            "llama-3.3-70b-zcpo",
            tmp_path,
            tiny_model,
            8,
            FAKE_SRUN_TRAINING="record",
            SGLANG_SERVER_URLS=f"{first.url},{second.url}",
        )
    assert done.returncode == 0, job_output(done, tmp_path)
    dry_run, train = steps  # no conversion (done), no servers to start
    assert dry_run["command"][-2:] == ["--nproc", "64"] and len(train["tasks"]) == 64
    assert {task["SLURMD_NODENAME"] for task in train["tasks"]} == set(hosts)
    config = load_run_config(train["command"][2], train["command"][3:])
    assert config.rollout.sglang.server_urls == [first.url, second.url]
    assert config.rollout.sglang.router_url is None and config.parallel.pipeline == 2
    assert train["env"]["ZCPO_SGLANG_API_KEY"] is None  # attached servers: the user's key, none generated


def test_a_layout_variable_of_the_old_scripts_is_refused_naming_the_config(tmp_path, tiny_model):
    done, _, steps = run_job("qwen2.5-32b-zcpo", tmp_path, tiny_model, 5, TRAIN_TP="4")
    assert done.returncode != 0 and not steps
    assert "TRAIN_TP is not read: the layout is parallel.* of examples/qwen2.5-32b-zcpo/config.yaml" in done.stderr


def test_the_long_context_job_needs_the_reward_function():
    done = subprocess.run(
        ["bash", "examples/qwen3-4b-long-context-zcpo/train.sbatch"],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "REWARD_FUNCTION" in done.stderr
