"""The suite's own scheduling (tests/conftest.py): the groups it orders exist, and `make test` keeps its order."""

from pathlib import Path

from tests.conftest import GROUP_SECONDS, SHARED_GROUPS

ROOT = Path(__file__).resolve().parents[1]


def test_every_ordered_group_exists():
    stale = [g for g in GROUP_SECONDS if g not in SHARED_GROUPS.values() and not (ROOT / g).is_file()]
    assert not stale, f"GROUP_SECONDS names groups that are gone: {stale}"


def test_make_test_takes_the_groups_in_collection_order():
    makefile = (ROOT / "Makefile").read_text()
    command = next(line for line in makefile.splitlines() if "-m pytest" in line and "-n 2" in line)
    assert "--dist loadgroup" in command and "--no-loadscope-reorder" in command, command
