"""The ``algorithm:`` section of a run config: the algorithm's name, its switches and their validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

from megatron_zcpo.algorithms.advantages import REWARD_NORMS
from megatron_zcpo.algorithms.kl import KL_ESTIMATORS
from megatron_zcpo.algorithms.surrogates import AGGREGATIONS

ALGORITHM_NAMES = ("zcpo", "dapo", "grpo", "rpg", "gvpo")
DRIFTS = ("conditional_kl", "k1")
KL_LOSSES = ("none",) + KL_ESTIMATORS + ("full",)
F1_CONTROLS = ("none", "mask_clipped", "match_masked_norm")
RPG_REFERENCES = ("old", "ref")

# Switches whose default depends on the algorithm (None in the dataclass = "the preset's value").
PRESETS: Dict[str, Dict[str, Any]] = {
    "zcpo": {"reward_norm": "max_abs", "kl_loss": "none", "clip_c": None},
    "dapo": {"reward_norm": "std", "kl_loss": "none", "clip_c": None},
    "grpo": {"reward_norm": "std", "kl_loss": "k3", "clip_c": None},
    "rpg": {"reward_norm": "none", "kl_loss": "none", "clip_c": 3.0},
    "gvpo": {"reward_norm": "none", "kl_loss": "none", "clip_c": None},
}

_COMMON = {"name", "reward_norm", "eps"}
_SURROGATE = {"clip_low", "clip_high", "clip_c", "agg"}
# The switches each algorithm reads; any other switch moved off its default is a contradiction.
ALGORITHM_KEYS = {
    "zcpo": _COMMON | _SURROGATE | {"beta", "center", "length_normalize", "drift", "gate"},
    "dapo": _COMMON | _SURROGATE | {"kl_loss", "kl_coef", "f1_control", "kl_in_reward_coef"},
    "grpo": _COMMON | _SURROGATE | {"kl_loss", "kl_coef", "f1_control", "kl_in_reward_coef"},
    "rpg": _COMMON | _SURROGATE | {"rpg_kl_coef", "rpg_reference"},
    "gvpo": _COMMON | {"gvpo_beta"},
}
_OWNER = {
    "beta": "it is ZCPO's calibration weight (name=zcpo); the KL-loss weight of dapo/grpo is kl_coef",
    "center": "it is a ZCPO ablation switch (name=zcpo)",
    "length_normalize": "it is a ZCPO ablation switch (name=zcpo)",
    "drift": "it is a ZCPO ablation switch (name=zcpo)",
    "gate": "it is a ZCPO ablation switch (name=zcpo)",
    "kl_loss": "only the vanilla baselines dapo/grpo have a KL loss; ZCPO moves the reference into its "
    "coefficients and has no separate KL loss term",
    "kl_coef": "it weights the KL loss of the vanilla baselines dapo/grpo",
    "f1_control": "it controls the KL loss of the vanilla baselines dapo/grpo",
    "kl_in_reward_coef": "KL in the reward is a vanilla-baseline switch (dapo/grpo)",
    "rpg_kl_coef": "it is RPG's KL weight (name=rpg)",
    "rpg_reference": "it is RPG's choice of reference (name=rpg)",
    "gvpo_beta": "it is GVPO's KL temperature (name=gvpo)",
    "clip_low": "GVPO has no clipping",
    "clip_high": "GVPO has no clipping",
    "clip_c": "GVPO has no clipping",
    "agg": "GVPO's loss is per sequence, not aggregated over tokens",
}


@dataclass
class AlgorithmConfig:
    """The ``algorithm:`` section of the run config.

    name: zcpo | dapo (no KL) | grpo (std advantages + k3 KL loss) | rpg | gvpo.
    reward_norm: std | max_abs | none (None: the algorithm's preset, see PRESETS); eps: eps_adv.
    ZCPO: beta (calibration weight), and the ablations center, length_normalize,
    drift (conditional_kl | k1), gate.
    Clipped surrogates: clip_low, clip_high, clip_c (dual clip; None: off, rpg preset 3.0), agg.
    Vanilla KL baselines (dapo/grpo): kl_loss (none | k1 | k2 | k3 | full; None: preset, grpo k3),
    kl_coef, f1_control (none | mask_clipped = F1-B | match_masked_norm = F1-C),
    kl_in_reward_coef (R_i <- R_i - coef * sum_t (old - ref)).
    RPG: rpg_kl_coef, rpg_reference (old: the refreshed sampling policy, as in the RPG code;
    ref: the frozen reference). GVPO: gvpo_beta.
    """

    name: str = "zcpo"
    reward_norm: Optional[str] = None
    eps: float = 1e-6
    beta: float = 4.0
    center: bool = True
    length_normalize: bool = True
    drift: str = "conditional_kl"
    gate: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: Optional[float] = None
    agg: str = "token-mean"
    kl_loss: Optional[str] = None
    kl_coef: float = 0.001
    f1_control: str = "none"
    kl_in_reward_coef: float = 0.0
    rpg_kl_coef: float = 1e-4
    rpg_reference: str = "old"
    gvpo_beta: float = 0.1

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AlgorithmConfig:
        """Build from a mapping (YAML section); unknown keys raise naming ``algorithm.<key>``.

        Numbers given as strings (YAML reads ``1e-6`` as a string) are converted.
        """
        known = {field.name: field for field in fields(cls)}
        converted = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"algorithm.{key}: unknown key; known keys: {', '.join(sorted(known))}")
            if isinstance(value, str) and key in _FLOAT_KEYS:
                try:
                    value = float(value)
                except ValueError:
                    raise ValueError(f"algorithm.{key}: expected a number, got {value!r}") from None
            converted[key] = value
        return cls(**converted)

    def resolved(self) -> AlgorithmConfig:
        """A validated copy with the preset-dependent switches (None) filled in for ``name``."""
        self.validate()
        return self._with_presets()

    def validate(self) -> None:
        """Raise ValueError naming ``algorithm.<key>`` for a bad value or contradictory switches."""
        self._check_types()
        _check_choice("name", self.name, ALGORITHM_NAMES)
        _check_choice("reward_norm", self.reward_norm, REWARD_NORMS, optional=True)
        _check_choice("drift", self.drift, DRIFTS)
        _check_choice("agg", self.agg, AGGREGATIONS)
        _check_choice("kl_loss", self.kl_loss, KL_LOSSES, optional=True)
        _check_choice("f1_control", self.f1_control, F1_CONTROLS)
        _check_choice("rpg_reference", self.rpg_reference, RPG_REFERENCES)
        _check_number("eps", self.eps, low=0.0, low_inclusive=False)
        _check_number("beta", self.beta, low=0.0)
        _check_number("clip_low", self.clip_low, low=0.0, high=1.0)
        _check_number("clip_high", self.clip_high, low=0.0)
        if self.clip_c is not None:
            _check_number("clip_c", self.clip_c, low=1.0, low_inclusive=False, finite=False)
        for key in ("kl_coef", "kl_in_reward_coef", "rpg_kl_coef"):
            _check_number(key, getattr(self, key), low=0.0)
        _check_number("gvpo_beta", self.gvpo_beta, low=0.0, low_inclusive=False)

        config = self._with_presets()
        defaults = AlgorithmConfig(name=self.name)._with_presets()
        for key in sorted(_OWNER):
            if key not in ALGORITHM_KEYS[self.name] and getattr(config, key) != getattr(defaults, key):
                raise ValueError(
                    f"algorithm.{key}={getattr(config, key)!r} does not apply to "
                    f"algorithm.name={self.name!r}: {_OWNER[key]}"
                )
        if config.kl_loss == "none" and config.kl_coef != defaults.kl_coef:
            raise ValueError(f"algorithm.kl_coef={config.kl_coef!r} is set but algorithm.kl_loss is 'none'")
        if config.f1_control != "none" and config.kl_loss == "none":
            raise ValueError(
                f"algorithm.f1_control={config.f1_control!r} controls the KL loss, but algorithm.kl_loss is 'none'"
            )
        if config.f1_control == "match_masked_norm" and config.kl_loss not in KL_ESTIMATORS:
            raise ValueError(
                "algorithm.f1_control='match_masked_norm' measures the KL gradient with respect to "
                f"the sampled log-probs and needs algorithm.kl_loss in {KL_ESTIMATORS}, "
                f"got {config.kl_loss!r}"
            )

    def _with_presets(self) -> AlgorithmConfig:
        preset = PRESETS[self.name]
        return dataclasses.replace(
            self,
            **{
                key: (preset[key] if getattr(self, key) is None else getattr(self, key))
                for key in ("reward_norm", "kl_loss")
            },
            clip_c=preset["clip_c"] if self.clip_c is None else self.clip_c,
        )

    def _check_types(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in _FLOAT_KEYS:
                if value is None and field.name == "clip_c":
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"algorithm.{field.name}: expected a number, got {value!r}")
            elif field.name in _BOOL_KEYS:
                if not isinstance(value, bool):
                    raise ValueError(f"algorithm.{field.name}: expected true or false, got {value!r}")
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"algorithm.{field.name}: expected a string, got {value!r}")


_FLOAT_KEYS = {
    "eps",
    "beta",
    "clip_low",
    "clip_high",
    "clip_c",
    "kl_coef",
    "kl_in_reward_coef",
    "rpg_kl_coef",
    "gvpo_beta",
}
_BOOL_KEYS = {"center", "length_normalize", "gate"}


def _check_choice(key: str, value: Any, choices: tuple, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in choices:
        raise ValueError(f"algorithm.{key}: {value!r} is not one of {', '.join(choices)}")


def _check_number(
    key: str, value: float, *, low: float, high: float = math.inf, low_inclusive: bool = True, finite: bool = True
) -> None:
    if finite and not math.isfinite(value):
        raise ValueError(f"algorithm.{key}: must be finite, got {value!r}")
    below = value < low if low_inclusive else value <= low
    if below or (high != math.inf and value >= high) or math.isnan(value):
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and < {high}" if high != math.inf else "")
        raise ValueError(f"algorithm.{key}: must be {bound}, got {value!r}")
