"""The run configuration of ``zcpo train``: one dataclass tree, YAML + ``key=value`` overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.algorithms import build_algorithm
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.data.config import DataConfig
from megatron_zcpo.diagnostics.config import DiagnosticsConfig
from megatron_zcpo.megatron.lora import LoraConfig
from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rewards.config import RewardConfig
from megatron_zcpo.rollout.async_rollout import ON_STALE
from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingConfig
from megatron_zcpo.training.config import ParallelConfig, TrainConfig, check_context_parallel
from megatron_zcpo.utils.config_loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_yaml,
    to_dict,
    validate_tree,
)


@dataclass
class ModelSource:
    """The ``model:`` section: where weights, architecture and tokenizer come from.

    ``path``: a Hugging Face model directory (config.json + safetensors; converted in memory,
    fine for small models) or a Megatron model checkpoint written by
    tools/convert_hf_to_megatron.py or by a training run (``.../weights``; loads at any TP/PP
    with only this rank's shard read: the way for 32B/70B). ``reference``: the frozen reference
    (default: the same as ``path``). ``tokenizer``: a directory with tokenizer files (default:
    ``path``, or ``path/hf`` for converted checkpoints). ``architecture``: random initialisation
    of this architecture instead of ``path`` (tests). ``preset``: the architecture of ``path`` by
    name (megatron_zcpo/convert/presets.py), so ``zcpo plan`` needs nothing downloaded; once
    ``path`` exists, its shapes (layers, widths, heads, vocabulary) must be the preset's.
    ``lora``: train LoRA adapters on the frozen ``path`` instead of every weight (its keys:
    :class:`~megatron_zcpo.megatron.lora.LoraConfig`); the reference is then the base with the
    adapters off, so ``reference`` stays unset and no second model is loaded.
    ``trust_remote_code``: load a tokenizer that is code shipped with the checkpoint (Moonlight's
    and Kimi-K2's tiktoken tokenizers; transformers' ``trust_remote_code``).
    """

    path: Optional[str] = None
    reference: Optional[str] = None
    tokenizer: Optional[str] = None
    architecture: Optional[ModelConfig] = None
    preset: Optional[str] = None
    lora: Optional[LoraConfig] = None
    trust_remote_code: bool = False

    def validate(self) -> None:
        if (self.path is None) == (self.architecture is None):
            raise ValueError("exactly one of model.path and model.architecture must be set")
        if self.lora is not None and self.reference is not None:
            raise ValueError(
                f"model.reference={self.reference!r} with model.lora: a LoRA run's reference is its base "
                "(model.path) with the adapters off; leave model.reference unset"
            )
        if self.path is None and self.tokenizer is None:
            raise ValueError("model.tokenizer is required with model.architecture")
        if self.preset is not None:
            from megatron_zcpo.convert.presets import preset_model_config

            preset_model_config(self.preset)  # an unknown name lists the presets
        for key in ("path", "reference", "tokenizer"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                raise ValueError(f"model.{key}={value!r} does not exist")


@dataclass
class SGLangSection:
    """``rollout.sglang``: attach to running servers (``server_urls``) or launch them (``launch``).

    Keys of ``client`` go to megatron_zcpo.rollout.sglang.client.SGLangEngineConfig (timeouts,
    concurrency, weight_sync "distributed" | "disk", bucket_bytes, ...); keys of ``launch`` go to
    megatron_zcpo.rollout.sglang.server.SGLangServerConfig (tp_size, base_port, router, ...).
    """

    server_urls: List[str] = field(default_factory=list)
    router_url: Optional[str] = None
    launch: Optional[Dict[str, Any]] = None
    client: Dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig
        from megatron_zcpo.rollout.sglang.server import SGLangServerConfig

        if self.launch is not None and self.server_urls:
            raise ValueError("rollout.sglang: give either server_urls (attach) or launch (start servers), not both")
        # Catch misspelt keys and disagreeing timeouts now, not when rank 0 starts the engine.
        routed = bool(self.router_url) or (self.launch is not None and self.launch.get("router", True))
        from_dict(
            SGLangEngineConfig,
            {"server_urls": ["http://check"], "router_url": "http://check" if routed else None, **self.client},
            prefix="rollout.sglang.client",
        ).validate()
        if self.launch is not None:
            from_dict(SGLangServerConfig, self.launch, prefix="rollout.sglang.launch").validate("rollout.sglang.launch")


ROLLOUT_MODES = ("sync", "overlap", "async")


@dataclass
class RolloutConfig:
    """The ``rollout:`` section: engine, sampling, group size and dynamic sampling."""

    engine: str = "embedded"  # embedded (CPU default, tests) | sglang (GPU clusters)
    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # G
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: List[int] = field(default_factory=list)  # the tokenizer's EOS is always added
    seed: int = 1234
    quantization: Optional[str] = None  # "fp8": the rollout policy holds FP8 weights (modelopt)
    # sync: on-policy, rollout -> train -> push. overlap: step k+1's rollout is generated while step k
    # trains (one step off-policy). async: a producer keeps the engine busy, the trainer takes groups
    # as they complete, responses continue across pushes (megatron_zcpo/rollout/async_rollout.py).
    # overlap and async turn train.importance_sampling on unless it is set. (`overlap: true` is read
    # as `mode: overlap`, `overlap: false` as `mode: sync`.)
    mode: str = "sync"
    max_staleness: int = 1  # weight versions a trained token may lag behind the trainer (overlap, async)
    on_stale: str = "drop"  # async: drop (counted) or correct (IS) groups with a token older than max_staleness
    # disaggregated: the engine on GPUs of its own; colocated: on the training GPUs, the two taking
    # turns (megatron_zcpo/rollout/placement.py; SGLang servers launched with --enable-memory-saver).
    placement: str = "disaggregated"
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    sglang: SGLangSection = field(default_factory=SGLangSection)

    def validate(self) -> None:
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"rollout.engine must be 'embedded' or 'sglang', got {self.engine!r}")
        for key in ("prompts_per_step", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")
        if self.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt must be >= 2 (groups need G >= 2), got {self.samples_per_prompt}"
            )
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"rollout.quantization must be null or 'fp8', got {self.quantization!r}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout.mode must be one of {ROLLOUT_MODES}, got {self.mode!r}")
        if self.mode != "sync" and self.max_staleness < 1:
            raise ValueError(
                f"rollout.max_staleness must be >= 1 with rollout.mode={self.mode} (the rollout in "
                f"flight is at least one version behind), got {self.max_staleness}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"rollout.on_stale must be one of {ON_STALE}, got {self.on_stale!r}")
        self._check_placement()

    def _check_placement(self) -> None:
        from megatron_zcpo.rollout.placement import PLACEMENTS

        if self.placement not in PLACEMENTS:
            raise ValueError(f"rollout.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement != "colocated":
            return
        if self.mode != "sync":
            raise ValueError(
                f"rollout.mode={self.mode} generates while the trainer trains; with "
                "rollout.placement=colocated both would need the same GPUs' memory at once: "
                "set rollout.mode=sync or rollout.placement=disaggregated"
            )
        if self.sglang.client.get("weight_sync") == "distributed":
            raise ValueError(
                "rollout.sglang.client.weight_sync=distributed broadcasts over NCCL between separate GPUs; "
                "with rollout.placement=colocated the servers share the trainer's GPUs: use 'tensor' "
                "(CUDA IPC, the default on GPUs) or 'disk' (the default without CUDA)"
            )
        if self.sglang.launch is not None and self.sglang.launch.get("enable_memory_saver") is False:
            raise ValueError(
                "rollout.sglang.launch.enable_memory_saver=false: rollout.placement=colocated needs it "
                "(the servers release their memory while the trainer trains)"
            )


@dataclass
class EvalConfig:
    """The ``eval:`` section: held-out accuracy (avg@k, pass@k) with the rollout engine."""

    every: int = 0  # steps between evaluations (0: only at the start and the end)
    at_start: bool = True
    at_end: bool = True
    data: Optional[DataConfig] = None  # default: the training data's source with eval_seed
    num_prompts: int = 64
    k: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens
    seed: int = 4321

    def validate(self) -> None:
        for key in ("every", "num_prompts", "k"):
            if getattr(self, key) < (0 if key == "every" else 1):
                raise ValueError(f"eval.{key} is out of range: {getattr(self, key)}")


@dataclass
class CheckpointConfig:
    """The ``checkpoint:`` section."""

    dir: Optional[str] = None  # default: <logging.run_dir>/checkpoints
    every: int = 0  # steps between checkpoints (0: only at the end)
    keep_last: int = 2
    resume: str = "auto"  # auto (latest in dir, if any) | never | a checkpoint path
    # Seconds a stop signal leaves the run to checkpoint and exit (the examples' `--signal=B:USR1@300`; for
    # a preemption, the partition's GraceTime): a stop during an update whose finish and save would take
    # longer exits at once without saving (the newest checkpoint then holds the run: see checkpoint.every).
    stop_grace_s: float = 300.0

    def validate(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ValueError(
                f"checkpoint.every must be >= 0 and checkpoint.keep_last >= 1, got {self.every}, {self.keep_last}"
            )
        if not self.stop_grace_s >= 0:
            raise ValueError(f"checkpoint.stop_grace_s must be >= 0 seconds, got {self.stop_grace_s}")
        if self.resume not in ("auto", "never") and not Path(self.resume).exists():
            raise ValueError(f"checkpoint.resume={self.resume!r}: must be 'auto', 'never' or an existing checkpoint")


@dataclass
class LoggingConfig:
    """The ``logging:`` section: where the run writes, and which sinks."""

    run_dir: str = "runs/zcpo"
    console: str = "table"  # table (progress bar + per-step table) | plain | quiet
    tensorboard: bool = True
    wandb_project: Optional[str] = None  # W&B logging when set (needs the wandb extra)

    def validate(self) -> None:
        from megatron_zcpo.recipe.metrics_log import WANDB_MISSING, wandb_available

        if self.console not in ("table", "plain", "quiet"):
            raise ValueError(f"logging.console must be table|plain|quiet, got {self.console!r}")
        if self.wandb_project and not wandb_available():
            raise ValueError(f"logging.wandb_project is set but {WANDB_MISSING}")


@dataclass
class RunConfig:
    """Everything one ``zcpo train`` run needs, validated at start-up."""

    model: ModelSource = field(default_factory=ModelSource)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(task="basic_arithmetic"))
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def validate(self) -> None:
        """Cross-section checks (each section validates itself first)."""
        self.diagnostics.check_algorithm(self.algorithm)
        check_context_parallel(self.parallel, self.train, build_algorithm(self.algorithm), self.diagnostics.enabled)
        if self.train.importance_sampling.enabled and self.algorithm.name == "gvpo":
            raise ValueError("train.importance_sampling: algorithm gvpo takes no per-token weights")
        if self.rollout.quantization and not self.train.importance_sampling.enabled:
            raise ValueError(
                "rollout.quantization needs train.importance_sampling.enabled=true "
                "(the quantised rollout policy differs from the trained one)"
            )
        if "quantization" in self.rollout.sglang.client:
            raise ValueError("set rollout.quantization, not rollout.sglang.client.quantization")
        if self.train.routing_replay != "none" and self.rollout.engine == "sglang":
            # The engine's routing: replayed under R3, compared with (routing/* metrics) under R2.
            sglang = self.rollout.sglang
            if self.train.routing_replay == "rollout" and not sglang.client.get("return_routed_experts"):
                raise ValueError(
                    "train.routing_replay=rollout needs rollout.sglang.client.return_routed_experts=true "
                    "(SGLang >= 0.5.7 servers launched with --enable-return-routed-experts)"
                )
            if (
                sglang.client.get("return_routed_experts")
                and sglang.launch is not None
                and not sglang.launch.get("return_routed_experts")
            ):
                raise ValueError(
                    "rollout.sglang.client.return_routed_experts needs "
                    "rollout.sglang.launch.return_routed_experts=true (--enable-return-routed-experts)"
                )
        if self.rollout.placement == "colocated" and not self.train.reference_offload:
            raise ValueError(
                "train.reference_offload=false with rollout.placement=colocated keeps the reference on the GPU "
                "while the engine generates there: leave train.reference_offload unset (true when colocated)"
            )
        if self.rollout.mode == "async" and (self.tools.enabled or self.train.routing_replay != "none"):
            raise ValueError(
                "rollout.mode=async continues responses across weight pushes one request at a time: it does not "
                "support tools.enabled (multi-turn) or train.routing_replay (set them off, or rollout.mode=overlap)"
            )
        self._check_lora()
        if (
            self.rollout.placement == "colocated"
            and self.rollout.sglang.client.get("weight_sync") == "tensor"
            and (self.parallel.pipeline > 1 or self.parallel.expert > 1)
        ):
            raise ValueError(
                "rollout.sglang.client.weight_sync=tensor feeds each server TP rank from the trainer rank on its GPU, "
                "which walks the whole model in its own replica: with parallel.pipeline > 1 or parallel.expert > 1 "
                "no rank holds it; use weight_sync=disk (the default then)"
            )
        if self.tools.enabled and self.train.routing_replay != "none":
            raise ValueError("tools.enabled: multi-turn rollouts do not support train.routing_replay (set it to none)")
        held_out = self.eval.data
        if self.tools.enabled and held_out is not None:
            for key in ("chat_template", "enable_thinking"):
                if getattr(held_out, key) != getattr(self.data, key):
                    raise ValueError(
                        f"eval.data.{key}={getattr(held_out, key)!r} differs from data.{key}="
                        f"{getattr(self.data, key)!r}: with tools.enabled one tool-turn format follows both "
                        "(the tool turns are rendered as the prompts are)"
                    )
        if self.tools.enabled and self.tools.max_total_tokens <= self.data.max_prompt_length:
            raise ValueError(
                f"tools.max_total_tokens={self.tools.max_total_tokens} must exceed data.max_prompt_length="
                f"{self.data.max_prompt_length} (it is the budget of the prompt and every turn)"
            )
        policy_cap = self.rollout.max_new_tokens * (self.tools.max_turns if self.tools.enabled else 1)
        if self.reward.overlong_penalty and self.reward.max_response_length != policy_cap:
            if self.tools.enabled:
                raise ValueError(
                    f"reward.max_response_length={self.reward.max_response_length} must equal rollout.max_new_tokens "
                    f"x tools.max_turns = {policy_cap} (with tools the overlong penalty counts the policy's tokens "
                    "over all its turns)"
                )
            raise ValueError(
                f"reward.max_response_length={self.reward.max_response_length} must equal rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens} (the overlong penalty is measured against the generation cap)"
            )

    def _check_lora(self) -> None:
        """``model.lora.push: adapter`` needs SGLang's LoRA serving, fed from a directory the servers read."""
        lora = self.model.lora
        if lora is None or lora.push != "adapter":
            return
        if self.rollout.engine != "sglang":
            raise ValueError(
                "model.lora.push=adapter loads the adapter into SGLang's LoRA serving: it needs rollout.engine=sglang "
                "(the embedded engine takes model.lora.push=merged)"
            )
        if not self.rollout.sglang.client.get("weight_dir"):
            raise ValueError(
                "model.lora.push=adapter writes each version's adapter where the servers read it: set "
                "rollout.sglang.client.weight_dir (a directory the servers can read)"
            )
        if self.rollout.quantization:
            raise ValueError("model.lora.push=adapter serves the base as launched: rollout.quantization must be null")
        if self.rollout.mode == "async":
            raise ValueError(
                "model.lora.push=adapter unloads the older adapter at each push while requests paused across it still "
                "name it: rollout.mode=async takes model.lora.push=merged"
            )

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.logging.run_dir) / "checkpoints")


def read_rollout_mode(data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` (a run config as a plain dict) with the older ``rollout.overlap`` (true: ``mode: overlap``,
    false: ``mode: sync``) read as ``rollout.mode``; the two disagreeing are refused, naming both keys."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or "overlap" not in rollout:
        return data
    data, rollout = dict(data), dict(rollout)
    data["rollout"] = rollout
    overlap = rollout.pop("overlap")
    if not isinstance(overlap, bool):
        raise ConfigError(f"rollout.overlap must be true or false (it stands for rollout.mode), got {overlap!r}")
    mode = rollout.setdefault("mode", "overlap" if overlap else "sync")
    if overlap != (mode == "overlap"):  # (overlap: false beside mode: async agrees)
        raise ConfigError(
            f"rollout.overlap={str(overlap).lower()} and rollout.mode={rollout['mode']} disagree: "
            "set rollout.mode alone (sync | overlap | async)"
        )
    return data


def _derived_defaults(data: Dict[str, Any]) -> Dict[str, Any]:
    """Fill keys whose default follows another key: ``rollout.overlap`` is read as ``rollout.mode``; the
    overlong penalty's L_max is the generation cap (with tools: per turn, times tools.max_turns), and its
    buffer L_cache 1/5 of it up to 4,096 (the paper: 20,480 and 4,096); overlapped and asynchronous
    rollouts turn the importance-sampling correction on unless it is set; colocated placement offloads
    the reference between uses unless ``train.reference_offload`` is set."""
    data = read_rollout_mode(data)
    rollout = data.get("rollout") or {}
    train = data.get("train")
    if (
        isinstance(rollout, dict)
        and rollout.get("mode") in ("overlap", "async")
        and (train is None or isinstance(train, dict))
    ):
        sampling = data.setdefault("train", {}).setdefault("importance_sampling", {})
        if isinstance(sampling, dict):
            sampling.setdefault("enabled", True)
    if (
        isinstance(rollout, dict)
        and rollout.get("placement") == "colocated"
        and isinstance(data.get("train", {}), dict)
    ):
        # the reference leaves the GPU between experience passes: the engine needs the room
        data.setdefault("train", {}).setdefault("reference_offload", True)
    reward = data.setdefault("reward", {}) if isinstance(data.get("reward", {}), dict) else data["reward"]
    tools = data.get("tools") if isinstance(data.get("tools"), dict) else {}
    turns = tools.get("max_turns", ToolsConfig.max_turns) if tools.get("enabled") else 1
    if isinstance(reward, dict):
        cap = rollout.get("max_new_tokens", RolloutConfig.max_new_tokens)
        cap = reward.setdefault("max_response_length", cap * turns if isinstance(turns, int) else cap)
        if isinstance(cap, int):
            reward.setdefault("overlong_buffer", min(4096, max(1, cap // 5)))
    return data


def build_run_config(data: Dict[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from a plain dict; errors name the offending key."""
    config = from_dict(RunConfig, _derived_defaults(dict(data)))
    validate_tree(config)
    return config


def load_run_config(path: Optional[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``path`` (YAML; None for defaults only), apply ``key=value`` overrides, validate."""
    data = load_yaml(path) if path else {}
    return build_run_config(apply_overrides(data, overrides))


def dump_run_config(config: RunConfig) -> str:
    """The config as YAML (what the run actually used, all defaults filled in)."""
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)


__all__ = [
    "RunConfig",
    "ConfigError",
    "load_run_config",
    "build_run_config",
    "dump_run_config",
    "ModelSource",
    "RolloutConfig",
    "EvalConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "SGLangSection",
]
