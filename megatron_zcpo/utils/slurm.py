"""Slurm environment helpers shared by the launcher of training ranks and of rollout servers."""

from __future__ import annotations

import re
from typing import List


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand Slurm's compressed host list ("gpu[01-03,7],login1") into host names, in order.

    The same expansion ``scontrol show hostnames`` does, for the bracket syntax Slurm uses
    (ranges keep their zero padding). Raises ``ValueError`` naming a malformed list.
    """
    hosts: List[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", nodelist.strip()):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"malformed Slurm node list {nodelist!r} (range {part!r})")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}")
    if not hosts:
        raise ValueError(f"malformed Slurm node list {nodelist!r}")
    return hosts
