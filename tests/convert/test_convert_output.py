"""The converters' outputs: written whole into a fresh directory (an existing one refused unless
overwritten, never mixed with old files), and a training step or run directory exported with its tokenizer."""

import json
from pathlib import Path

import pytest
import torch

from megatron_zcpo.convert.output_dir import atomic_output_dir
from megatron_zcpo.testing import run_distributed
from tests.convert.test_convert import _make_hf_model, _save_tokenizer

HF_CASE = dict(vocab_size=300, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False)


def test_an_output_directory_is_replaced_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        with atomic_output_dir(out):
            pass
    with pytest.raises(RuntimeError, match="half-way"):
        with atomic_output_dir(out, overwrite=True) as fresh:
            (fresh / "new.txt").write_text("new")
            raise RuntimeError("half-way")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "old.txt").read_text() == "old"
    with atomic_output_dir(out, overwrite=True) as fresh:
        (fresh / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(ValueError, match="would delete the input"):
        with atomic_output_dir(tmp_path, overwrite=True, source=out):
            pass
    with atomic_output_dir(tmp_path / "empty_is_fine"):
        pass


def _fake_training_run(root: Path) -> None:
    """A run directory as the trainer leaves it: config.yaml naming model.path, a complete step whose
    weights/ is a model checkpoint without hf/ files (the trainer writes none)."""
    import shutil

    step = root / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(root / "source_megatron", step / "weights", ignore=shutil.ignore_patterns("hf"))
    (step / "trainer_state.pt").write_bytes(b"")
    (root / "run" / "config.yaml").write_text(f"model:\n  path: {root / 'hf'}\n  tokenizer: null\n")


def _convert_into_existing(rank, world, root):
    """Both converters into occupied directories, with and without overwrite; exports of a training
    step and of its run directory; what each raised."""
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    setup_megatron()
    root, errors = Path(root), {}
    convert_hf_to_megatron(root / "hf", root / "source_megatron")
    _fake_training_run(root)
    for name, convert in (
        ("to_megatron", lambda overwrite: convert_hf_to_megatron(root / "hf", root / "megatron", overwrite=overwrite)),
        ("to_hf", lambda overwrite: convert_megatron_to_hf(root / "megatron", root / "hf_old", overwrite=overwrite)),
    ):
        try:
            convert(False)
        except FileExistsError as error:
            errors[name] = str(error)
        convert(True)
    for name, source in (("step", root / "run" / "checkpoints" / "step_00000002"), ("run", root / "run")):
        convert_megatron_to_hf(source, root / f"export_{name}")
    try:
        convert_megatron_to_hf(root / "hf", root / "not_written")
    except FileNotFoundError as error:
        errors["not_a_checkpoint"] = str(error)
    return errors


def test_converters_refuse_occupied_outputs_replace_them_whole_and_export_a_run(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

    _make_hf_model(tmp_path / "hf", "qwen2", HF_CASE, torch.float32, seed=0)
    _save_tokenizer(tmp_path / "hf", HF_CASE["vocab_size"])
    with SafetensorsCheckpoint(tmp_path / "hf") as source:
        original = {name: source.tensor(name) for name in source.names()}
    # an older export of other weights as one file, and a stale file in the Megatron output
    (tmp_path / "hf_old").mkdir()
    save_file({name: tensor + 1 for name, tensor in original.items()}, str(tmp_path / "hf_old" / "model.safetensors"))
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "stale.distcp").write_text("from another run")
    first = run_distributed(_convert_into_existing, 1, str(tmp_path), timeout=600)[0]
    assert "megatron exists and is not empty: pass --overwrite" in first["to_megatron"]
    assert "hf_old exists and is not empty: pass --overwrite" in first["to_hf"]
    assert not (tmp_path / "megatron" / "stale.distcp").exists()
    assert not (tmp_path / "hf_old" / "model.safetensors").exists()  # transformers would load it first
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_old").state_dict()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name
    assert "a training step (<run_dir>/checkpoints/step_XXXXXXXX" in first["not_a_checkpoint"]
    assert not (tmp_path / "not_written").exists()
    for name in ("step", "run"):
        export = tmp_path / f"export_{name}"
        assert (export / "tokenizer.json").is_file() and (export / "model.safetensors.index.json").is_file()
        config = json.loads((export / "config.json").read_text())
        assert config["num_hidden_layers"] == HF_CASE["num_hidden_layers"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no leftovers
    # a run directory as model.path (its newest step's weights) brings its run's tokenizer along
    from megatron_zcpo.recipe.config import build_run_config
    from megatron_zcpo.recipe.inputs import load_tokenizer

    run = build_run_config({"model": {"path": str(tmp_path / "run")}, "logging": {"run_dir": str(tmp_path / "r2")}})
    assert load_tokenizer(run).convert_tokens_to_ids("fox") == 4
