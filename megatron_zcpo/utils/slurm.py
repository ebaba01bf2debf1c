"""Slurm environment helpers shared by the launcher of training ranks and of rollout servers."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from typing import List, Sequence

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand Slurm's compressed host list ("gpu[01-03,7],login1") into host names, in order.

    Asks ``scontrol show hostnames`` when it is on PATH (Slurm's own expansion, whatever the
    cluster's naming); without it, or when it fails (a container without ``slurm.conf``),
    :func:`parse_slurm_nodelist` expands the list. Raises ``ValueError`` naming a malformed list.
    """
    if shutil.which("scontrol"):
        try:
            result = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            result = None
        hosts = result.stdout.split() if result is not None and result.returncode == 0 else []
        if hosts:
            return hosts
    return parse_slurm_nodelist(nodelist)


def parse_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm host list without Slurm, the way Slurm's hostlist library does.

    Forms: names separated by commas or white space outside brackets; bracket groups of
    comma-separated numbers and ``lo-hi`` ranges that keep the zero padding of ``lo``
    (``gpu[007-010]``); text before, between and after groups (``rack[1-2]-node[01-02]-ib``).
    Several groups expand to their cartesian product in Slurm's order: the last group varies
    fastest, then the first, second, ... up to the one before the last (Slurm expands the prefix's
    groups right to left around the last group). Returns the host names, ``len >= 1``. Raises
    ``ValueError`` naming the list and the part it cannot parse (unbalanced or nested brackets, an
    empty group, a non-numeric or descending range, an empty list).
    """
    hosts: List[str] = []
    for token in _split_top_level(nodelist):
        hosts.extend(_expand_token(token, nodelist))
    if not hosts:
        raise ValueError(f"malformed Slurm node list {nodelist!r} (no host names)")
    return hosts


def _split_top_level(nodelist: str) -> List[str]:
    """Split on commas and white space that are outside brackets; check the brackets balance."""
    tokens: List[str] = []
    current: List[str] = []
    depth = 0
    for char in nodelist:
        if char == "[":
            if depth:
                raise ValueError(f"malformed Slurm node list {nodelist!r} (nested '[')")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"malformed Slurm node list {nodelist!r} (']' without '[')")
            depth = 0
        if depth == 0 and (char == "," or char.isspace()):
            tokens.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"malformed Slurm node list {nodelist!r} ('[' without ']')")
    tokens.append("".join(current))
    return [token for token in tokens if token]


def _expand_group(group: str, nodelist: str) -> List[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (each range padded to the width of its low end)."""
    numbers: List[str] = []
    for part in group.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"malformed Slurm node list {nodelist!r} (range {part!r} in [{group}])")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"malformed Slurm node list {nodelist!r} (descending range {part!r})")
        numbers.extend(f"{number:0{len(low)}d}" for number in range(int(low), int(high) + 1))
    return numbers


def _expand_token(token: str, nodelist: str) -> List[str]:
    """One comma-free entry (``rack[1-2]-node[01-02]``) -> its host names in Slurm's order."""
    pieces = _GROUP.split(token)  # literal, group, literal, group, ..., literal
    literals: Sequence[str] = pieces[0::2]
    groups = [_expand_group(group, nodelist) for group in pieces[1::2]]
    if len(groups) <= 1:
        return [literals[0] + number + literals[1] for number in groups[0]] if groups else [token]
    # Slurm nests the loops: group n-2 outermost, then n-3, ..., 0, and the last group innermost.
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1]
    hosts = []
    for combination in itertools.product(*(groups[index] for index in order)):
        numbers = dict(zip(order, combination))
        hosts.append("".join(literals[i] + numbers[i] for i in range(len(groups))) + literals[-1])
    return hosts
