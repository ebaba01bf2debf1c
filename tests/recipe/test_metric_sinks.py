"""The optional W&B metric sink: asking for it without the ``wandb`` extra is a clear error naming the extra."""

import sys

import pytest

from megatron_zcpo.recipe import metrics_log
from megatron_zcpo.recipe.config import build_run_config
from megatron_zcpo.utils.config_loader import ConfigError

ARCHITECTURE = {
    "family": "qwen2",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture
def without_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as when it is not installed


def test_config_asking_for_wandb_without_the_extra_names_key_and_extra(without_wandb, tmp_path):
    data = {
        "model": {"architecture": ARCHITECTURE, "tokenizer": str(tmp_path)},
        "logging": {"run_dir": str(tmp_path), "wandb_project": "zcpo"},
    }
    with pytest.raises((ConfigError, ValueError)) as error:
        build_run_config(data)
    assert "logging.wandb_project" in str(error.value)
    assert "pip install megatron-zcpo[wandb]" in str(error.value)
    data["logging"]["wandb_project"] = None
    assert build_run_config(data).logging.wandb_project is None


def test_metrics_logger_without_wandb_names_the_extra(without_wandb, tmp_path):
    assert not metrics_log.wandb_available()
    with pytest.raises(ImportError, match=r"pip install megatron-zcpo\[wandb\]"):
        metrics_log.MetricsLogger(tmp_path, console="quiet", tensorboard=False, wandb_project="zcpo")
