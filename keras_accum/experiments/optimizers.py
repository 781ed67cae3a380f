"""Optimizers by name: the one place the harness turns a name into one.

Runs (`run_config`), the invariance study's methods and the bench's
contenders all name their optimizers through `build`:

>>> opt = build("gradient_accumulation", 4, {"learning_rate": 1e-3}, inner="adamw")
>>> type(opt).__name__, type(opt.inner_optimizer).__name__, opt.steps
('GradientAccumulation', 'AdamW', 4)
"""

from __future__ import annotations

from typing import Any

import keras

import keras_accum as ka
from keras_accum.validation import check_choice

OPTIMIZERS = ("invariant_adam", "update_accumulation_adam", "gradient_accumulation")
INNER_OPTIMIZERS = ("adam", "adamw", "sgd")


def build(
    name: str,
    steps: Any,
    hyper: dict[str, Any],
    *,
    inner: str = "adam",
    weight_decay: float | None = None,
    scaling_rule: str | None = None,
) -> keras.optimizers.Optimizer:
    """The keras_accum optimizer `name` with `steps` micro-batches per update.

    `hyper` holds learning_rate and optionally beta_1, beta_2, epsilon (Adam's
    names; for an inner "sgd" beta_1 is its momentum). `inner` names the
    optimizer that "gradient_accumulation" wraps; `scaling_rule` is
    InvariantAdam's.
    """
    check_choice("optimizer", name, OPTIMIZERS)
    check_choice("inner_optimizer", inner, INNER_OPTIMIZERS)
    if name == "invariant_adam":
        return ka.InvariantAdam(
            **hyper, steps=steps, weight_decay=weight_decay, scaling_rule=scaling_rule
        )
    if name == "update_accumulation_adam":
        return ka.UpdateAccumulationAdam(**hyper, steps=steps, weight_decay=weight_decay)
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    if inner == "sgd":
        momentum = hyper.get("beta_1", 0.0)
        wrapped = keras.optimizers.SGD(hyper["learning_rate"], momentum=momentum, **decay)
    elif inner == "adamw":
        wrapped = keras.optimizers.AdamW(**hyper, **decay)
    else:
        wrapped = keras.optimizers.Adam(**hyper, **decay)
    return ka.GradientAccumulation(wrapped, steps=steps)
