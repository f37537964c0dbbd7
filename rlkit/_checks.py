"""Argument checks shared by the public functions: one wording for every "must be an int" error."""
from __future__ import annotations

import numbers


def int_at_least(value, name: str, minimum: int = 1, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) ``>= minimum``;
    ``hint`` follows the requirement in the message (``" or None (the whole batch)"``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        need = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {need}{hint}, got {value!r}")
