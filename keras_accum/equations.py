"""The equations the optimizers' rules share, as pure `keras.ops` functions.

The Adam ones follow `keras.optimizers.Adam`'s form, so that `steps=1`
equals Keras's Adam bit for bit. See docs/ALGORITHMS.md.
"""

import math

from keras import ops


def adam_moment_changes(m, v, g, rate_1, rate_2, square=None):
    """((g - m)(1 - beta_1), (g**2 - v)(1 - beta_2)), Keras's form;
    `rate_i` = 1 - beta_i, `square` replaces g**2 when given."""
    square = ops.square(g) if square is None else square
    return (g - m) * rate_1, (square - v) * rate_2


def adam_step(m, v, alpha, epsilon):
    """alpha m / (sqrt(v) + epsilon): the step Adam subtracts."""
    return (m * alpha) / (ops.sqrt(v) + epsilon)


def adam_alpha(learning_rate, count, beta_1, beta_2, dtype):
    """alpha = lr sqrt(1 - beta_2**count) / (1 - beta_1**count) in `dtype`."""
    lr = ops.cast(learning_rate, dtype)
    count = ops.cast(count, dtype)
    beta_1_power = ops.power(ops.cast(beta_1, dtype), count)
    beta_2_power = ops.power(ops.cast(beta_2, dtype), count)
    return lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)


def decayed(theta, weight_decay, learning_rate):
    """Decoupled weight decay: theta - theta weight_decay lr."""
    return theta - theta * weight_decay * learning_rate


def one_minus_beta(beta, kappa, form):
    """1 - beta_k for `kappa` micro-batches: kappa (1 - beta) ("linear"),
    1 - beta ** kappa ("power") or 1 - beta ("fixed"); float32 for tensors."""
    if form == "fixed":
        return 1 - beta
    if isinstance(kappa, (int, float)):
        return kappa * (1 - beta) if form == "linear" else 1 - beta**kappa
    kappa = ops.cast(kappa, "float32")
    if form == "linear":
        return kappa * (1 - beta)
    # 1 - beta ** kappa = -expm1(kappa log beta), accurate when beta ~ 1.
    return -ops.expm1(kappa * ops.cast(math.log(beta), "float32")) if beta > 0 else 1.0
