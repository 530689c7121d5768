"""Byte counts for people: the one formatter behind the memory estimate and the run listings."""

from __future__ import annotations

IEC = ("KiB", "MiB", "GiB", "TiB")  # as nvidia-smi and torch print them
SHORT = ("KB", "MB", "GB", "TB")  # the same 1024-based steps under short names, as `ls -h` does


def human(n: int, names: tuple[str, ...] = IEC, decimals: int = 2) -> str:
    """Bytes in the largest 1024-based unit that keeps the number at least 1 (the last of `names` at
    most); under 1024, plain bytes."""
    for power in range(len(names), 0, -1):
        scale = 1024**power
        if abs(n) >= scale:
            return f"{n / scale:.{decimals}f} {names[power - 1]}"
    return f"{n} B"
