"""Argument checks shared by the library and its harness.

Each raises a one-line `ValueError` that names the argument and echoes the
value, in the Keras style:

>>> check_int("steps", 0)
Traceback (most recent call last):
...
ValueError: `steps` must be an integer >= 1. Received: steps=0
>>> check_float("epsilon", 1e-7, minimum=0.0)
1e-07
>>> check_bool("jit_compile", "no")
Traceback (most recent call last):
...
ValueError: `jit_compile` must be True or False. Received: jit_compile='no'
>>> check_rate("learning_rate", -0.1)
Traceback (most recent call last):
...
ValueError: `learning_rate` must be a finite number >= 0.0. Received: learning_rate=-0.1
>>> check_choice("rule", "linear", ("invariant", "sqrt", "power"))
Traceback (most recent call last):
...
ValueError: `rule` must be one of 'invariant', 'sqrt', 'power'. Received: rule='linear'
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (numpy integers too, not bools), else ValueError."""
    if isinstance(value, bool) or not is_integer(value) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    return int(value)


def is_integer(value: Any) -> bool:
    """True for a Python or numpy integer, not for a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is a bool (not 0, 1 or a string), else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_minimum: bool = False,
    open_maximum: bool = False,
) -> float:
    """`value` as a finite float within the bounds (closed unless `open_*`), else ValueError."""
    if minimum is not None and maximum is not None:
        low = "(" if open_minimum else "["
        high = ")" if open_maximum else "]"
        span = f" in {low}{minimum!r}, {maximum!r}{high}"
    elif minimum is not None:
        span = f" {'>' if open_minimum else '>='} {minimum!r}"
    elif maximum is not None:
        span = f" {'<' if open_maximum else '<='} {maximum!r}"
    else:
        span = ""
    error = ValueError(f"`{name}` must be a finite number{span}. Received: {name}={value!r}")
    # Numbers only: a string such as "1e-3" is a config mistake, not a float.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error
    number = float(value)
    if not math.isfinite(number):
        raise error
    if minimum is not None and (number < minimum or (open_minimum and number == minimum)):
        raise error
    if maximum is not None and (number > maximum or (open_maximum and number == maximum)):
        raise error
    return number


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` if it is one of `choices`, else ValueError listing them."""
    choices = tuple(choices)
    if value not in choices or isinstance(value, bool) and True not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}. "
            f"Received: {name}={value!r}"
        )
    return value


def check_rate(name: str, value: Any) -> Any:
    """A finite number >= 0, or a schedule, callable, tensor or variable (unchecked)."""
    if callable(value) or (hasattr(value, "dtype") and hasattr(value, "shape")):
        return value
    check_float(name, value, minimum=0.0)
    return value
