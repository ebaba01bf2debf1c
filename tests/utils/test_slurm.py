"""Slurm host lists: the parser against a table of Slurm's expansions, and scontrol preferred when present."""

import itertools
import os
import random

import pytest

from megatron_zcpo.utils.slurm import expand_slurm_nodelist, parse_slurm_nodelist

# What Slurm's hostlist library (src/common/hostlist.c, `scontrol show hostnames`) gives for each
# form: ranges keep the width of their low end, groups inside a name expand with the last group
# fastest and the others from the first on, commas inside brackets separate ranges and outside
# separate names.
SLURM_EXPANSIONS = [
    ("node001", ["node001"]),
    ("gpu[07-09,12],login1,h[1-2]", ["gpu07", "gpu08", "gpu09", "gpu12", "login1", "h1", "h2"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("rack[1-2]-node[01-02]-ib", ["rack1-node01-ib", "rack1-node02-ib", "rack2-node01-ib", "rack2-node02-ib"]),
    ("a[1-2]b[1-2]c[1-2]", ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"]),
    ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("[1-2]x", ["1x", "2x"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("dgx-a100-[1-2],dgx-h100-07", ["dgx-a100-1", "dgx-a100-2", "dgx-h100-07"]),
    ("x[1-2] y[3-4]", ["x1", "x2", "y3", "y4"]),
    ("p[1-2].cluster.org,q", ["p1.cluster.org", "p2.cluster.org", "q"]),
    ("r[0-1]s[00-01,5]", ["r0s00", "r0s01", "r0s5", "r1s00", "r1s01", "r1s5"]),
]


@pytest.mark.parametrize("nodelist,expected", SLURM_EXPANSIONS)
def test_parser_matches_slurm_expansions(nodelist, expected):
    assert parse_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "nodelist",
    [
        "gpu[a-3]",
        "gpu[3-1]",
        "gpu[]",
        "gpu[1-2",
        "gpu1-2]",
        "gpu[[1-2]]",
        "gpu[1-2]x]",
        "gpu[1,,2]",
        "",
        " , ",
        "gpu[-1]",
        "gpu[1--2]",
    ],
)
def test_parser_raises_on_what_slurm_rejects(nodelist):
    with pytest.raises(ValueError, match="malformed Slurm node list"):
        parse_slurm_nodelist(nodelist)


def _compress(numbers, width):
    """Slurm-style range string for sorted ints (the inverse of one bracket group)."""
    parts = []
    for _, run in itertools.groupby(enumerate(numbers), key=lambda item: item[1] - item[0]):
        run = [number for _, number in run]
        low, high = f"{run[0]:0{width}d}", f"{run[-1]:0{width}d}"
        parts.append(low if low == high else f"{low}-{high}")
    return ",".join(parts)


def test_property_random_two_group_lists_round_trip():
    """Random prefix[a]mid[b]suffix entries: the expansion is the product, outer group first, padded."""
    rng = random.Random(0)
    for _ in range(200):
        widths = rng.randint(1, 3), rng.randint(1, 3)
        groups = [sorted(rng.sample(range(10**w), rng.randint(1, min(6, 10**w)))) for w in widths]
        prefix, middle, suffix = (
            rng.choice(["n", "gpu-", ""]),
            rng.choice(["-", "x", "_r"]),
            rng.choice(["", "-ib", ".a"]),
        )
        entry = f"{prefix}[{_compress(groups[0], widths[0])}]{middle}[{_compress(groups[1], widths[1])}]{suffix}"
        expected = [f"{prefix}{a:0{widths[0]}d}{middle}{b:0{widths[1]}d}{suffix}" for a in groups[0] for b in groups[1]]
        assert parse_slurm_nodelist(entry + ",login") == expected + ["login"], entry


def _fake_scontrol(tmp_path, body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/bash\n" + body)
    (bin_dir / "scontrol").chmod(0o755)
    return str(bin_dir)


def test_scontrol_on_path_is_asked_first(tmp_path, monkeypatch):
    # Distinct output, so the test tells which expansion ran; it echoes its arguments back.
    bin_dir = _fake_scontrol(tmp_path, 'echo "from-scontrol $1 $2"; echo "$3"\n')
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    assert expand_slurm_nodelist("node[1-2]-ib") == ["from-scontrol", "show", "hostnames", "node[1-2]-ib"]


def test_parser_used_without_scontrol_or_when_it_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert expand_slurm_nodelist("rack[1-2]-node[01-02]") == parse_slurm_nodelist("rack[1-2]-node[01-02]")
    bin_dir = _fake_scontrol(tmp_path, "echo 'no slurm.conf' >&2; exit 1\n")
    monkeypatch.setenv("PATH", bin_dir)
    assert expand_slurm_nodelist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    with pytest.raises(ValueError, match="malformed Slurm node list"):
        expand_slurm_nodelist("gpu[a-3]")
