"""The megatron-core internals we rely on: listed once (megatron/compat.py), all present in the installed release."""

import ast
import importlib
import pathlib
import re
import types

import pytest

from megatron_zcpo.megatron import compat

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("internal", compat.MEGATRON_INTERNALS, ids=lambda internal: internal.target)
def test_every_listed_internal_matches_the_installed_megatron_core(internal):
    assert compat.check_internal(internal) == []


def test_the_suite_runs_on_the_tested_release_and_the_image_installs_it():
    assert compat.installed_version() == compat.TESTED_MEGATRON_CORE
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG MCORE_VERSION=(\S+)$", dockerfile, re.M).group(1) == compat.TESTED_MEGATRON_CORE
    assert "python -m megatron_zcpo.megatron.compat" in dockerfile  # the build checks the list


def test_the_checker_reports_what_moved():
    moved = [
        compat.MegatronInternal("megatron.core.dist_checkpointing.strategies.nowhere:Strategy", "x"),
        compat.MegatronInternal("megatron.core.models.gpt:GPTModel", "x", keywords=("no_such_keyword",)),
        compat.MegatronInternal("megatron.core.transformer.module:Float16Module", "x", positional=("module", "config")),
        compat.MegatronInternal("megatron.core.packed_seq_params:PackedSeqParams", "x", attributes=("qkv_layout",)),
    ]
    problems = compat.check_internals(moved)
    assert [bool(p) for p in problems.values()] == [True, True, True, True]
    assert "missing" in problems[moved[0].target][0]
    assert "no_such_keyword" in problems[moved[1].target][0]
    assert "positional order" in problems[moved[2].target][0]
    assert "qkv_layout" in problems[moved[3].target][0]


def _megatron_imports():
    """(file, module, name) for every ``from megatron.core... import name`` in the package."""
    for path in sorted((ROOT / "megatron_zcpo").rglob("*.py")):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
                for alias in node.names:
                    yield path.relative_to(ROOT), node.module, alias.name


def _listed_objects():
    objects = []
    for internal in compat.MEGATRON_INTERNALS:
        module, _, path = internal.target.partition(":")
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):  # GPTModel for "...:GPTModel.forward" too
            objects.append(compat.resolve(f"{module}:{'.'.join(parts[:depth])}"))
        objects += [getattr(objects[-1], name, None) for name in internal.attributes]
    return objects


def test_every_megatron_import_in_the_package_is_listed():
    listed = _listed_objects()
    targets = [internal.target for internal in compat.MEGATRON_INTERNALS]
    unlisted = []
    for path, module, name in _megatron_imports():
        value = getattr(importlib.import_module(module), name)
        if isinstance(value, types.ModuleType):
            covered = any(target.startswith(value.__name__ + ":") for target in targets) or any(
                v is value for v in listed
            )
        else:
            covered = any(v is value for v in listed)
        if not covered:
            unlisted.append(f"{path}: from {module} import {name}")
    assert unlisted == [], "add these to megatron_zcpo/megatron/compat.py"
