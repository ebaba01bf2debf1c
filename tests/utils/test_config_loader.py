"""utils/config_loader.load_yaml: a key written twice in a run config is an error naming file, key and lines."""

import pytest

from megatron_zcpo.utils.config_loader import ConfigError, load_yaml


def test_a_repeated_key_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: a\ntrain:\n  steps: 2\n  lr: 1.0e-6\n  steps: 3\n")
    with pytest.raises(ConfigError) as error:
        load_yaml(path)
    message = str(error.value)
    assert f"{path}:6:3: YAML syntax error" in message, message
    assert "key 'steps' is written twice (first on line 4)" in message, message


def test_the_same_key_in_different_sections_is_fine(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: a}\nreference: {path: b}\n")
    assert load_yaml(path) == {"model": {"path": "a"}, "reference": {"path": "b"}}
