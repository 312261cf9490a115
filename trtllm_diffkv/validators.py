"""The type and range checks of settings: the one home of "a positive integer", "True or False", "in (0, 1]".

Every check takes the field's name and its value, returns the value unchanged when it is allowed, and otherwise
raises ``ValueError("{name}={value!r} must be {allowed}")``: the message names the field and what it allows. A
caller whose tests pin other words for ``allowed`` passes them (``allowed=...``); ``name`` may carry a prefix
(``"workload w: num_requests"``).

Integers are Python ``int`` (``integral=True``: any :class:`numbers.Integral`, NumPy's included), never ``bool``
(``True`` is an ``int`` in Python, and a flag passed where a size belongs is a mistake). Numbers are ``int`` or
``float``, never ``bool`` and never NaN.

Pure Python: :mod:`trtllm_diffkv.config` and every layer above it may import it.
"""
from __future__ import annotations

import math
import numbers

__all__ = ["is_int", "is_number", "positive_int", "optional_positive_int", "non_negative_int",
           "optional_non_negative_int", "boolean", "optional_boolean", "number_in_range", "choice"]


def is_int(value, *, integral: bool = False) -> bool:
    """Whether ``value`` is an integer: an ``int`` (``integral``: any :class:`numbers.Integral`), not a ``bool``."""
    return isinstance(value, numbers.Integral if integral else int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` (not a ``bool``) and not NaN (infinities pass: ranges refuse
    them)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        not (isinstance(value, float) and math.isnan(value))


def _refuse(name: str, value, allowed: str):
    raise ValueError(f"{name}={value!r} must be {allowed}")


def _int_at_least(name: str, value, low: int, allowed: str, integral: bool):
    if not is_int(value, integral=integral) or value < low:
        _refuse(name, value, allowed)
    return value


def positive_int(name: str, value, *, allowed: str = "a positive integer", integral: bool = False):
    """``value`` if it is an integer >= 1 (:func:`is_int`).

    Raises:
        ValueError: ``"{name}={value!r} must be {allowed}"``.
    """
    return _int_at_least(name, value, 1, allowed, integral)


def optional_positive_int(name: str, value, *, allowed: str = "a positive integer (or None)"):
    """``None``, or ``value`` if it is an integer >= 1.

    Raises:
        ValueError: ``"{name}={value!r} must be {allowed}"``.
    """
    return None if value is None else positive_int(name, value, allowed=allowed)


def non_negative_int(name: str, value, *, allowed: str = "an integer >= 0"):
    """``value`` if it is an integer >= 0 (:func:`is_int`).

    Raises:
        ValueError: ``"{name}={value!r} must be {allowed}"``.
    """
    return _int_at_least(name, value, 0, allowed, False)


def optional_non_negative_int(name: str, value, *, allowed: str = "an integer >= 0 (or None)"):
    """``None``, or ``value`` if it is an integer >= 0.

    Raises:
        ValueError: ``"{name}={value!r} must be {allowed}"``.
    """
    return None if value is None else non_negative_int(name, value, allowed=allowed)


def boolean(name: str, value):
    """``value`` if it is ``True`` or ``False`` (not 0 or 1).

    Raises:
        ValueError: ``"{name}={value!r} must be True or False"``.
    """
    if not isinstance(value, bool):
        _refuse(name, value, "True or False")
    return value


def optional_boolean(name: str, value):
    """``value`` if it is ``True``, ``False`` or ``None``.

    Raises:
        ValueError: ``"{name}={value!r} must be True, False or None"``.
    """
    if value is not None and not isinstance(value, bool):
        _refuse(name, value, "True, False or None")
    return value


def number_in_range(name: str, value, low: float, high: float, *, low_open: bool = False, high_open: bool = False,
                    allowed: str | None = None):
    """``value`` if it is a finite number (:func:`is_number`) in the interval from ``low`` to ``high`` (closed at
    each end unless ``low_open`` / ``high_open``).

    Raises:
        ValueError: ``"{name}={value!r} must be {allowed}"``; ``allowed`` defaults to the interval, e.g.
            ``"in (0, 1]"``.
    """
    finite = is_number(value) and not (isinstance(value, float) and math.isinf(value))
    above = finite and (value > low if low_open else value >= low)
    if not (above and (value < high if high_open else value <= high)):
        _refuse(name, value, allowed or f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
    return value


def choice(name: str, value, allowed_values):
    """``value`` if it is one of ``allowed_values`` (strings).

    Raises:
        ValueError: ``"{name}={value!r}; allowed: 'a', 'b'"``.
    """
    if not isinstance(value, str) or value not in allowed_values:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(map(repr, allowed_values))}")
    return value
