"""Each optimizer's arithmetic, written once in `keras.ops`.

Pure functions of tensors and scalars: no variable, no branch, no backend.
Under TensorFlow `keras_accum.folds` runs them inside its compiled kernels
(on resource handles, per replica); under JAX and PyTorch
`keras_accum.drivers.portable` runs them on the optimizer's variables. One window
of kappa micro-batches g_1 .. g_kappa (ALGORITHMS.md):

* `GradientAccumulation`: `window_sum` (S and W) per micro-batch; at the
  window's end the inner optimizer's step on S / W.
* `InvariantAdam`: `decayed_moments` per micro-batch (`adam_moments` when
  every window is one micro-batch); at the end `adam_step`, after
  `decayed`.
* `UpdateAccumulationAdam`: `adam_moments` and `adam_step` into A per
  micro-batch; at the end theta - A, after `decayed`.

`one_minus_beta` is InvariantAdam's 1 - beta_k of one window.
`adam_alpha` is `keras.optimizers.Adam`'s bias-corrected rate, in its own
form, so that `steps=1` equals Keras's Adam bit for bit on every backend.
"""

import math
import operator

from keras import ops


def window_sum(total, value, start):
    """S = value at the window's start, else S + value (`start` a boolean
    scalar, or a Python bool where the step runs eagerly)."""
    if isinstance(start, bool):
        return value if start else total + value
    return ops.where(start, value, total + value)


def adam_moment_changes(m, v, g, rate_1, rate_2, square=None):
    """What one gradient adds to Adam's moments, in Keras's form:
    (g - m)(1 - beta_1) and (g**2 - v)(1 - beta_2); `rate_i` = 1 - beta_i.
    `square` replaces g**2 (under `tf.distribute`, the square of a
    replica's micro-batch rebuilt from its share of the mean)."""
    square = ops.square(g) if square is None else square
    return (g - m) * rate_1, (square - v) * rate_2


def adam_moments(m, v, g, rate_1, rate_2):
    """Adam's moments after one gradient: m and v plus
    `adam_moment_changes`."""
    change_m, change_v = adam_moment_changes(m, v, g, rate_1, rate_2)
    return m + change_m, v + change_v


def decayed_moments(m, v, g, keep, take, times=operator.mul):
    """InvariantAdam's fold of one micro-batch: m keep_1 + g take_1 and
    v keep_2 + g**2 take_2.

    keep_i = 1 - first (1 - beta_i,k) (first = 1 at the window's first
    micro-batch: the decay, applied once per window), take_1 =
    (1 - beta_1,k) / steps and take_2 = (1 - beta_2,k) / steps times the
    replica factor (the window's mean of g and of g**2). `times(x, factor)`
    multiplies a gradient term (TensorFlow passes `multiply_no_nan`, so that
    a skipped micro-batch's NaN times 0 is 0)."""
    (keep_1, keep_2), (take_1, take_2) = keep, take
    return m * keep_1 + times(g, take_1), v * keep_2 + times(ops.square(g), take_2)


def adam_step(m, v, alpha, epsilon):
    """alpha m / (sqrt(v) + epsilon): the step Adam subtracts."""
    return (m * alpha) / (ops.sqrt(v) + epsilon)


def adam_alpha(learning_rate, count, beta_1, beta_2, dtype):
    """alpha = lr sqrt(1 - beta_2**count) / (1 - beta_1**count) in `dtype`,
    as `keras.optimizers.Adam` computes it."""
    lr = ops.cast(learning_rate, dtype)
    count = ops.cast(count, dtype)
    beta_1_power = ops.power(ops.cast(beta_1, dtype), count)
    beta_2_power = ops.power(ops.cast(beta_2, dtype), count)
    return lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)


def decayed(theta, weight_decay, learning_rate):
    """Decoupled weight decay: theta - theta weight_decay lr."""
    return theta - theta * weight_decay * learning_rate


def one_minus_beta(beta, kappa, form):
    """1 - beta_k for a window of `kappa` micro-batches, `form` one of
    `keras_accum.scaling.BETA_FORMS`'s: kappa (1 - beta) ("linear"),
    1 - beta ** kappa ("power") or 1 - beta ("fixed"). Python numbers in, a
    Python number out; else a float32 tensor."""
    if form == "fixed":
        return 1 - beta
    if isinstance(kappa, (int, float)):
        return kappa * (1 - beta) if form == "linear" else 1 - beta**kappa
    kappa = ops.cast(kappa, "float32")
    if form == "linear":
        return kappa * (1 - beta)
    # 1 - beta ** kappa = -expm1(kappa log beta), accurate when beta ~ 1.
    return -ops.expm1(kappa * ops.cast(math.log(beta), "float32")) if beta > 0 else 1.0
