"""Slurm's compressed host lists (`node[01-03,07],gpu5`) expanded in Slurm's order, as `scontrol show
hostnames` does: the first host of a step's node list is its node 0."""

from __future__ import annotations

import itertools
import re

MAX_HOSTS = 100_000  # a node list expanding to more is garbage, not a cluster


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list in Slurm's order: `node[01-03,07],gpu5` -> node01 node02 node03 node07
    gpu5. A number keeps the width of its range's first bound (`[08-10]`: 08 09 10; `[8-10]`: 8 9 10);
    several bracket groups in one name multiply (`r[1-2]n[1-2]`: r1n1 r1n2 r2n1 r2n2). ValueError otherwise."""
    hosts = []
    for item in _top_level_items(text):
        choices = []
        for part in re.split(r"(\[[^\[\]]*\])", item):  # names and [...] groups alternate
            if part.startswith("["):
                choices.append(_numbers(part[1:-1]))
            elif part and not re.fullmatch(r"[A-Za-z0-9._-]+", part):
                raise ValueError(f"{part!r} is not part of a host name")
            else:
                choices.append([part])
        count = 1
        for choice in choices:
            count *= len(choice)
        if len(hosts) + count > MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts += ["".join(name) for name in itertools.product(*choices)]
    return hosts


def _top_level_items(text: str) -> list[str]:
    """`a[1,2],b` -> ['a[1,2]', 'b']: commas inside brackets are ranges, not host separators."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError("brackets do not pair up")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or not all(items):
        raise ValueError("brackets do not pair up" if depth else "an empty host name")
    return items


def _numbers(ranges: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7']."""
    numbers = []
    for piece in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not match or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(f"[{ranges}] is not a list of numbers and ranges like [01-03,7]")
        low, high = int(match[1]), int(match[2] or match[1])
        if len(numbers) + high - low >= MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts")
        numbers += [f"{n:0{len(match[1])}d}" for n in range(low, high + 1)]
    return numbers
