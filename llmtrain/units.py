"""Byte counts for people: the one formatter behind the memory estimate and the run listings, and the
one reader of sizes people write (`80GB`, `24GiB`, `50e9`)."""

from __future__ import annotations

import re

IEC = ("KiB", "MiB", "GiB", "TiB")  # as nvidia-smi and torch print them
SHORT = ("KB", "MB", "GB", "TB")  # the same 1024-based steps under short names, as `ls -h` does
# Written sizes: decimal units as disks are sold (GB = 1e9), binary ones as memory is counted (GiB = 2^30).
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_SIZE = re.compile(r"\s*([0-9][0-9_]*\.?[0-9]*(?:e[0-9]+)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """'24GB' (24e9), '24GiB' (24 * 2^30), '1.5TB', '50e9' or plain bytes -> bytes (0 allowed);
    ValueError for anything else, negative sizes included."""
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(text)
    return int(float(match.group(1).replace("_", "")) * _UNITS[unit])


def human(n: int, names: tuple[str, ...] = IEC, decimals: int = 2) -> str:
    """Bytes in the largest 1024-based unit that keeps the number at least 1 (the last of `names` at
    most); under 1024, plain bytes."""
    for power in range(len(names), 0, -1):
        scale = 1024**power
        if abs(n) >= scale:
            return f"{n / scale:.{decimals}f} {names[power - 1]}"
    return f"{n} B"
