"""Memory sizes as users write them; no heavy imports (config validation uses it)."""

from __future__ import annotations

from effitrain.errors import UserError


def parse_size(text: str) -> int:
    """'8GiB', '512MiB', '8GB', '1.5G', '2000000000' -> bytes (G/GiB binary, GB decimal)."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise UserError(f"`{text}` is not a memory size", "write e.g. 8GiB, 512MiB or 16GB")
    number, prefix, suffix = float(match[1]), match[2].upper(), match[3].lower()
    power = " KMGT".index(prefix or " ")
    base = 1000 if suffix == "b" and prefix else 1024
    return int(number * base**power)
