"""Hyperparameter scaling rules for changing the number of micro-batches.

The rules, their sources and when to use each: docs/ALGORITHMS.md.
"""

from __future__ import annotations

from typing import Any

from keras_accum.equations import one_minus_beta  # noqa: F401  (0.3.0's name, kept)
from keras_accum.validation import check_choice, check_float

RULES = ("invariant", "sqrt", "power", "fixed_beta_1")
# `InvariantAdam(scaling_rule=...)`: the rules applied per window.
SCALING_RULES = ("invariant", "power", "fixed_beta_1", None)
# How each rule scales (beta_1, beta_2) (see `scaled_beta`).
BETA_FORMS = {
    "invariant": ("linear", "linear"),
    "sqrt": ("linear", "linear"),
    "power": ("power", "power"),
    "fixed_beta_1": ("fixed", "power"),
    None: ("fixed", "fixed"),
}


def check_linear_beta(kappa: float, name: str, beta: float, argument: str = "rule") -> None:
    """Refuses 1 - beta' = kappa (1 - beta) where beta' <= 0, naming `argument`."""
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
    *,
    weight_decay: float | None = None,
    ema_momentum: float | None = None,
) -> dict[str, float]:
    """Scales Adam hyperparameters from kappa = 1 to `kappa` micro-batches.

    ::

        "invariant":    lr' = kappa lr,        1 - beta_i' = kappa (1 - beta_i)
        "sqrt":         lr' = sqrt(kappa) lr,  1 - beta_i' = kappa (1 - beta_i),
                        epsilon' = epsilon / sqrt(kappa)
        "power":        lr' = kappa lr,        beta_i' = beta_i ** kappa
        "fixed_beta_1": lr' = kappa lr,        beta_1' = beta_1, beta_2' = beta_2 ** kappa
        every rule:     ema_momentum' = ema_momentum ** kappa,
                        lr' weight_decay' = kappa lr weight_decay

    "invariant" is for `InvariantAdam`, "sqrt" for standard Adam (Malladi et
    al. 2022). See docs/ALGORITHMS.md.

    Args:
        kappa: micro-batches per update (steps x replicas), a number > 0.
        rule: "invariant", "sqrt", "power" or "fixed_beta_1".
        learning_rate, beta_1, beta_2, epsilon: the base values at kappa = 1.
        weight_decay, ema_momentum: optional base values, rescaled and
            returned only when given.

    Returns:
        dict with keys learning_rate, beta_1, beta_2, epsilon (and
        weight_decay, ema_momentum when given).

    Raises:
        ValueError: an invalid argument, or a linear rule making a beta <= 0.

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
    scaled_betas = {}
    for (name, beta), form in zip(betas.items(), BETA_FORMS[rule]):
        if form == "linear":
            check_linear_beta(kappa, name, beta)
        scaled_betas[name] = scaled_beta(beta, kappa_value, form)
    lr_factor = kappa_value**0.5 if rule == "sqrt" else kappa_value
    eps_factor = kappa_value**-0.5 if rule == "sqrt" else 1
    scaled = {
        "learning_rate": learning_rate * lr_factor,
        **scaled_betas,
        "epsilon": epsilon * eps_factor,
    }
    if weight_decay is not None:
        check_float("weight_decay", weight_decay, minimum=0.0)
        # lr' * weight_decay' = kappa * lr * weight_decay
        scaled["weight_decay"] = weight_decay * kappa_value / lr_factor
    if ema_momentum is not None:
        check_float("ema_momentum", ema_momentum, minimum=0.0, maximum=1.0)
        # rho' = rho ** kappa
        scaled["ema_momentum"] = ema_momentum**kappa_value
    return scaled


def scaled_beta(beta: float, kappa: float, form: str) -> float:
    """beta' for `kappa` micro-batches: 1 - kappa (1 - beta) ("linear"),
    beta ** kappa ("power") or beta ("fixed")."""
    if form == "linear":
        return 1 - kappa * (1 - beta)
    return beta**kappa if form == "power" else beta


def check_scaling_rule(rule: Any, beta_1: float, beta_2: float, max_kappa: int) -> Any:
    """Validates `scaling_rule` for windows of up to `max_kappa` micro-batches."""
    check_choice("scaling_rule", rule, SCALING_RULES)
    betas = (("beta_1", beta_1), ("beta_2", beta_2))
    for (name, beta), form in zip(betas, BETA_FORMS[rule]):
        if form == "linear":
            check_linear_beta(max_kappa, name, beta, argument="scaling_rule")
    return rule
