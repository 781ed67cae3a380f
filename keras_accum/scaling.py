"""Hyperparameter scaling rules for changing the number of micro-batches.

From a base tuned at kappa = 1 (one micro-batch per update), for kappa
micro-batches per update:

| rule        | learning_rate     | 1 - beta_i         | epsilon              |
|-------------|-------------------|--------------------|----------------------|
| "invariant" | kappa * lr        | kappa * (1 - beta) | same                 |
| "sqrt"      | sqrt(kappa) * lr  | kappa * (1 - beta) | epsilon / sqrt(kappa)|
| "power"     | kappa * lr        | beta_i ** kappa    | same                 |

"invariant" is the linear rule under which `InvariantAdam` curves do not
depend on kappa (Wang & Aitchison 2024); "sqrt" is the square-root rule for
standard Adam (Malladi et al. 2022, arXiv:2205.10287); "power" is the
invariant rule with the exponent form of the betas, which stays meaningful
when kappa * (1 - beta) >= 1. The linear beta rule is refused there, never
clipped silently.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from keras_accum.validation import check_choice, check_float

RULES = ("invariant", "sqrt", "power")
# `InvariantAdam(scaling_rule=...)`: the rules applied per window.
SCALING_RULES = ("invariant", "power", None)


def check_linear_beta(kappa: float, name: str, beta: float, argument: str = "rule") -> None:
    """Refuses the linear rule 1 - beta' = kappa (1 - beta) where it makes
    beta' <= 0, naming `argument` (the caller's name for the rule)."""
    # With a rounding margin: 10 * (1 - 0.9) is 0.9999999999999998.
    if kappa * (1 - beta) >= 1 - 1e-9:
        raise ValueError(
            f"kappa * (1 - {name}) = {kappa * (1 - beta):g} >= 1 makes the linear "
            f"rule meaningless ({name} <= 0) at kappa={kappa!r}. Use "
            f"{argument}='power' ({name} ** kappa) or a smaller kappa. "
            f"Received: kappa={kappa!r}, {name}={beta!r}"
        )


def scale_hyperparameters(
    kappa: float,
    rule: str,
    learning_rate: float,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
) -> dict[str, float]:
    """Scales Adam hyperparameters from kappa = 1 to `kappa` micro-batches.

    Args:
        kappa: micro-batches per update (steps x replicas), a number > 0.
        rule: "invariant", "sqrt" or "power" (see the module docstring).
        learning_rate, beta_1, beta_2, epsilon: the base values at kappa = 1.

    Returns:
        dict with keys learning_rate, beta_1, beta_2, epsilon.

    Example:
        >>> hp = scale_hyperparameters(kappa=4, rule="invariant",
        ...                            learning_rate=1e-3, beta_1=0.9)
        >>> round(hp["learning_rate"], 12), round(hp["beta_1"], 12)
        (0.004, 0.6)
        >>> scale_hyperparameters(kappa=16, rule="invariant", learning_rate=1e-3)
        Traceback (most recent call last):
        ...
        ValueError: kappa * (1 - beta_1) = 1.6 >= 1 makes the linear rule meaningless (beta_1 <= 0) at kappa=16. Use rule='power' (beta_1 ** kappa) or a smaller kappa. Received: kappa=16, beta_1=0.9
    """  # noqa: E501
    kappa_value = check_float("kappa", kappa, minimum=0.0, open_minimum=True)
    check_choice("rule", rule, RULES)
    check_float("learning_rate", learning_rate, minimum=0.0)
    check_float("epsilon", epsilon, minimum=0.0)
    betas = {"beta_1": beta_1, "beta_2": beta_2}
    for name, beta in betas.items():
        check_float(name, beta, minimum=0.0, maximum=1.0, open_maximum=True)
    if rule == "power":
        # beta' = beta ** kappa
        scaled_betas = {name: beta**kappa_value for name, beta in betas.items()}
    else:
        scaled_betas = {}
        for name, beta in betas.items():
            check_linear_beta(kappa, name, beta)
            # 1 - beta' = kappa * (1 - beta)
            scaled_betas[name] = 1 - kappa_value * (1 - beta)
    lr_factor = kappa_value**0.5 if rule == "sqrt" else kappa_value
    eps_factor = kappa_value**-0.5 if rule == "sqrt" else 1
    return {
        "learning_rate": learning_rate * lr_factor,
        **scaled_betas,
        "epsilon": epsilon * eps_factor,
    }


def check_scaling_rule(rule: Any, beta_1: float, beta_2: float, max_kappa: int) -> Any:
    """Validates `scaling_rule` and refuses a linear rule that would make a
    beta <= 0 for the largest window (`max_kappa` micro-batches)."""
    check_choice("scaling_rule", rule, SCALING_RULES)
    if rule == "invariant":
        for name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            check_linear_beta(max_kappa, name, beta, argument="scaling_rule")
    return rule


def one_minus_beta(beta: float, kappa: Any, rule: Any) -> Any:
    """1 - beta_k for a window of `kappa` micro-batches under `rule`:
    kappa (1 - beta) ("invariant"), 1 - beta ** kappa ("power") or 1 - beta
    (None). Python numbers in, a Python number out; else a float32 tensor."""
    if rule is None:
        return 1 - beta
    if isinstance(kappa, (int, float)):
        return kappa * (1 - beta) if rule == "invariant" else 1 - beta**kappa
    kappa = tf.cast(kappa, tf.float32)
    if rule == "invariant":
        return kappa * (1 - beta)
    # 1 - beta ** kappa = -expm1(kappa log beta), accurate when beta ~ 1.
    return -tf.math.expm1(kappa * tf.cast(math.log(beta), tf.float32)) if beta > 0 else 1.0
