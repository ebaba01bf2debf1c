"""``zcpo demo --compare --arms``: the named arms of a comparison and their ``:key=value`` config overrides.

An arm is a name from :data:`ARMS` optionally followed by ``:key=value`` overrides of the run
config, e.g. ``zcpo:algorithm.beta=1`` or ``dapo:algorithm.reward_norm=max_abs:train.optimizer.lr=3.7e-4``;
a list is comma-separated (``dapo,zcpo-beta0,zcpo``). The overrides are applied after the arm's own
changes and are validated like ``zcpo train``'s, with the arm and the key named.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_zcpo.utils.config_loader import ConfigError, apply_overrides, parse_override

# name -> (changes to the demo config, what the arm is). The paper's 2 x 2 (appendix B) is
# dapo / zcpo-beta0 (max-abs normalisation alone) / zcpo-std (the drift alone) / zcpo (both);
# the zcpo-no-* and zcpo-k1 arms are SPEC section 1's one-switch ablations.
ARMS: Dict[str, Tuple[dict, str]] = {
    "dapo": ({"algorithm": {"name": "dapo"}}, "DAPO without KL: std-normalised advantages"),
    "dapo-k3": (
        {"algorithm": {"name": "dapo", "kl_loss": "k3", "kl_coef": 0.04}},
        "DAPO + a k3 KL loss (kl_coef 0.04)",
    ),
    "zcpo": ({"algorithm": {"name": "zcpo"}}, "ZCPO: max-abs normalisation + the drift term (the demo's beta)"),
    "zcpo-beta0": (
        {"algorithm": {"name": "zcpo", "beta": 0.0}},
        "ZCPO with beta 0: max-abs normalisation alone, no drift (= dapo with reward_norm=max_abs)",
    ),
    "zcpo-std": (
        {"algorithm": {"name": "zcpo", "reward_norm": "std"}},
        "ZCPO with std normalisation: the drift term alone",
    ),
    "zcpo-k1": (
        {"algorithm": {"name": "zcpo", "drift": "k1"}},
        "ZCPO with the sampled k1 drift for the conditional KL",
    ),
    "zcpo-no-center": ({"algorithm": {"name": "zcpo", "center": False}}, "ZCPO without within-group centring"),
    "zcpo-no-length-norm": (
        {"algorithm": {"name": "zcpo", "length_normalize": False}},
        "ZCPO without length normalisation of the drift",
    ),
    "zcpo-no-gate": ({"algorithm": {"name": "zcpo", "gate": False}}, "ZCPO without the tied-group gate"),
    "zcpo-lora": (
        {
            "algorithm": {"name": "zcpo"},
            "model": {"lora": {"rank": 16, "alpha": 32.0}},
            "train": {"optimizer": {"lr": 2.0e-3}},
        },
        "ZCPO training LoRA adapters (rank 16, alpha 32, lr 2e-3) on the frozen warmed-up model; its reference "
        "is the base with the adapters off (no second model)",
    ),
    # The rollout modes (README, "On-policy (default), overlapped or asynchronous rollouts").
    "zcpo-overlap": (
        {"algorithm": {"name": "zcpo"}, "rollout": {"mode": "overlap"}},
        "ZCPO with overlapped rollouts (one step off-policy)",
    ),
    "zcpo-async": (
        {"algorithm": {"name": "zcpo"}, "rollout": {"mode": "async"}},
        "ZCPO with asynchronous rollouts (max_staleness 1, responses continued across pushes)",
    ),
}
LORA_ARM = "zcpo-lora"  # what `zcpo demo --lora` runs
DEFAULT_ARMS = "dapo,dapo-k3,zcpo"
# Keys the demo sets for every run itself: an arm that moved them would not be the demo's run.
DEMO_OWNED = ("model.path", "data.train_files", "eval.data", "logging.run_dir", "checkpoint.resume")
# An override starts where a ':' is followed by a dotted key and '='; a ':' inside a value (a
# reward function's "module:function") is not followed by one.
_OVERRIDE_START = re.compile(r":(?=[A-Za-z_][\w.]*=)")


@dataclass(frozen=True)
class Arm:
    """One arm: ``label`` as written (``zcpo:algorithm.beta=1``), the table ``name`` and its ``overrides``."""

    label: str
    name: str
    overrides: Tuple[str, ...]

    @property
    def directory(self) -> str:
        """The arm's folder name under ``--out``: the label with ':' as '+' and anything unusual as '_'."""
        return re.sub(r"[^\w.=+-]", "_", self.label.replace(":", "+"))

    def config(self, base: dict) -> dict:
        """``base`` (a plain run-config dict) with the arm's table changes and then its overrides."""
        config = merge(base, ARMS[self.name][0])
        try:
            return apply_overrides(config, self.overrides)
        except ConfigError as error:
            raise ConfigError(f"arm {self.label!r}: {error}") from None


def merge(base: dict, changes: dict) -> dict:
    """A deep copy of ``base`` with the nested mapping ``changes`` merged in (changes win)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else copy.deepcopy(value)
    return out


def split_arm_list(text: str) -> List[str]:
    """``"a,b:x=[1,2],c"`` -> ``["a", "b:x=[1,2]", "c"]``: commas split arms outside brackets and braces."""
    items, depth, current = [], 0, []
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    items.append("".join(current).strip())
    return items


def parse_arm(text: str) -> Arm:
    """One arm from ``name[:key=value[:key=value ...]]``; ConfigError naming the arm for an unknown
    name, a malformed override or one of the keys the demo sets itself (DEMO_OWNED)."""
    name, colon, rest = text.strip().partition(":")
    head, *overrides = _OVERRIDE_START.split(colon + rest)
    if head == ":":
        raise ConfigError(f"arm {text!r}: nothing after ':' (give key=value overrides or drop the ':')")
    if head:
        raise ConfigError(f"arm {text!r}: {head[1:]!r} after {name + ':'!r} is not a key=value override")
    if name not in ARMS:
        known = ", ".join(ARMS)
        raise ConfigError(
            f"arm {text!r}: unknown arm {name!r}; known arms: {known} "
            f"(each optionally followed by :key=value overrides)"
        )
    for override in overrides:
        try:
            path, _ = parse_override(override)
        except ConfigError as error:
            raise ConfigError(f"arm {text!r}: {error}") from None
        key = ".".join(path)
        owned = [k for k in DEMO_OWNED if key == k or key.startswith(k + ".")]
        if owned:
            raise ConfigError(f"arm {text!r}: {key} is set by the demo for every run and cannot be overridden")
    return Arm(label=text.strip(), name=name, overrides=tuple(overrides))


def parse_arms(text: str) -> List[Arm]:
    """The arms of ``--arms A,B,...`` in order; ConfigError for an empty entry, a bad arm (see
    :func:`parse_arm`) or two arms with the same label or folder."""
    arms = []
    for item in split_arm_list(text):
        if not item:
            raise ConfigError(f"--arms {text!r}: an empty arm (two commas in a row, or one at an end)")
        arms.append(parse_arm(item))
    for key in ("label", "directory"):
        seen: Dict[str, str] = {}
        for arm in arms:
            value = getattr(arm, key)
            if value in seen:
                raise ConfigError(
                    f"--arms {text!r}: arms {seen[value]!r} and {arm.label!r} share the "
                    f"{'folder ' if key == 'directory' else ''}name {value!r}; give each arm once"
                )
            seen[value] = arm.label
    return arms


def describe_arms(arms: Sequence[Arm]) -> List[str]:
    """One line per arm: its label and what it is (the table's description, then its overrides)."""
    return [
        f"{arm.label}: {ARMS[arm.name][1]}" + (f", with {', '.join(arm.overrides)}" if arm.overrides else "")
        for arm in arms
    ]
