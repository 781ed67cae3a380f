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

import math

RULES = ("invariant", "sqrt", "power")


def scale_hyperparameters(kappa, rule, learning_rate, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Scales Adam hyperparameters from kappa = 1 to `kappa` micro-batches.

    Args:
        kappa: micro-batches per update (steps x replicas), a number > 0.
        rule: "invariant", "sqrt" or "power" (see the module docstring).
        learning_rate, beta_1, beta_2, epsilon: the base values at kappa = 1.

    Returns:
        dict with keys learning_rate, beta_1, beta_2, epsilon.

    Example:
        >>> scale_hyperparameters(kappa=4, rule="invariant",
        ...                       learning_rate=1e-3, beta_1=0.9)["beta_1"]
        0.6
    """
    if (
        isinstance(kappa, bool)
        or not isinstance(kappa, (int, float))
        or not (kappa > 0 and math.isfinite(kappa))
    ):
        raise ValueError(f"`kappa` must be a finite number > 0. Received: kappa={kappa!r}")
    if rule not in RULES:
        raise ValueError(
            f"`rule` must be one of {', '.join(map(repr, RULES))}. Received: rule={rule!r}"
        )
    betas = {"beta_1": beta_1, "beta_2": beta_2}
    for name, beta in betas.items():
        if not 0 <= beta < 1:
            raise ValueError(f"`{name}` must be in [0, 1). Received: {name}={beta!r}")
    if rule == "power":
        scaled_betas = {name: beta**kappa for name, beta in betas.items()}
    else:
        scaled_betas = {}
        for name, beta in betas.items():
            # With a rounding margin: 10 * (1 - 0.9) is 0.9999999999999998.
            if kappa * (1 - beta) >= 1 - 1e-9:
                raise ValueError(
                    f"kappa * (1 - {name}) = {kappa * (1 - beta):g} >= 1 makes "
                    f"the linear rule meaningless ({name} <= 0). Use "
                    f"rule='power' ({name} ** kappa) or a smaller kappa. "
                    f"Received: kappa={kappa!r}, {name}={beta!r}"
                )
            # 1 - beta' = kappa * (1 - beta)
            scaled_betas[name] = 1 - kappa * (1 - beta)
    lr_factor = math.sqrt(kappa) if rule == "sqrt" else kappa
    eps_factor = 1 / math.sqrt(kappa) if rule == "sqrt" else 1
    return {
        "learning_rate": learning_rate * lr_factor,
        **scaled_betas,
        "epsilon": epsilon * eps_factor,
    }
