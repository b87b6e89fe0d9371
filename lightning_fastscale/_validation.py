"""Argument checks shared across the package, so every setting is refused with the same wording."""
from __future__ import annotations

from typing import Any


def positive_int(setting: str, value: Any, *, minimum: int = 1, hint: str = "") -> int:
    """Return ``value`` if it is an integer (not a bool) of at least ``minimum``, else ``ValueError`` (with ``hint``).

    Examples:
        >>> positive_int("data.batch_size", 32)
        32
        >>> positive_int("data.batch_size", 0)
        Traceback (most recent call last):
        ...
        ValueError: data.batch_size=0 must be a positive integer
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{setting}={value!r} must be {wanted}" + (f"; {hint}" if hint else ""))
    return value


def positive_number(setting: str, value: Any, *, hint: str = "") -> float:
    """Return ``value`` if it is a real number (not a bool) above 0, else raise ``ValueError``.

    Examples:
        >>> positive_number("bucket_cap_mb", 25)
        25
        >>> positive_number("bucket_cap_mb", -5, hint="DDP's bucket size in MB")
        Traceback (most recent call last):
        ...
        ValueError: bucket_cap_mb=-5 must be a number > 0; DDP's bucket size in MB
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{setting}={value!r} must be a number > 0" + (f"; {hint}" if hint else ""))
    return value
