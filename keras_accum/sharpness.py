"""Preconditioned sharpness: is a learning rate stable for Adam, and at kappa?

Adam with a frozen P = diag(sqrt(v_hat) + epsilon) is stable on a quadratic
while S = lambda_max(P^-1 H) (H the Hessian) stays below (Cohen et al. 2022,
arXiv:2207.14484)::

    threshold = (2 + 2 beta_1) / (lr (1 - beta_1)).

What a scaling rule does to it at kappa: docs/guides/diagnostics.md.

Example::

    scale = sharpness.adam_preconditioner(optimizer)  # P^-1/2, from its v
    s = sharpness.preconditioned_sharpness(
        lambda: loss_fn(y, model(x, training=False)), model.trainable_variables, scale
    )
    stable = float(s) < sharpness.stability_threshold(kappa * lr, beta_1_k)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

from keras_accum import _compat
from keras_accum._backend import tf
from keras_accum.scaling import scale_hyperparameters
from keras_accum.validation import check_float


def stability_threshold(learning_rate: float, beta_1: float) -> float:
    """(2 + 2 beta_1) / (lr (1 - beta_1)): Adam's largest stable preconditioned sharpness.

    >>> round(stability_threshold(1e-3, 0.9))
    38000

    Args:
        learning_rate: lr > 0.
        beta_1: in [0, 1).
    """
    check_float("learning_rate", learning_rate, minimum=0.0, open_minimum=True)
    check_float("beta_1", beta_1, minimum=0.0, maximum=1.0, open_maximum=True)
    return (2 + 2 * beta_1) / (learning_rate * (1 - beta_1))


def threshold_times_lr(kappa: float, rule: str, beta_1: float = 0.9) -> float:
    """Base lr x the threshold at the (lr_k, beta_1,k) `rule` gives at `kappa`.

    Independent of lr: 38 at kappa = 1, beta_1 = 0.9.

    Args:
        kappa: micro-batches per update.
        rule: a `scale_hyperparameters` rule.
        beta_1: the base beta_1.
    """
    h = scale_hyperparameters(kappa, rule, 1.0, beta_1)
    return stability_threshold(h["learning_rate"], h["beta_1"])


def _dot(a, b):
    return tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a, b)])


def hessian_vector_product(
    loss_fn: Callable[[], Any], variables: Sequence[Any], vector: Sequence[Any]
) -> list[tf.Tensor]:
    """H u of `loss_fn()` with respect to `variables`: the gradient of g . u.

    Args:
        loss_fn: a function of no arguments returning the scalar loss.
        variables: the variables H is taken with respect to.
        vector: u, one tensor per variable (their shapes).

    Returns:
        H u, one tensor per variable.
    """
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = loss_fn()
        g_dot_u = _dot(inner.gradient(loss, variables), vector)
    return outer.gradient(g_dot_u, variables)


def preconditioned_sharpness(
    loss_fn: Callable[[], Any],
    variables: Sequence[Any],
    scale: Sequence[Any] | None = None,
    iterations: int = 30,
    seed: int = 0,
) -> tf.Tensor:
    """The largest-magnitude eigenvalue of D H D, D = diag(`scale`) (TensorFlow).

    Power iteration ``u <- D H D u / |D H D u|`` from a seeded random unit
    vector; returns the Rayleigh quotient u . D H D u. With `scale` = P^-1/2
    (`adam_preconditioner`) that is S; with None, lambda_max(H). Wrap the
    call in a `tf.function` to run it repeatedly.

    Args:
        loss_fn: no-argument callable returning the loss on a fixed batch.
        variables: the trainable variables H is taken over.
        scale: one tensor per variable (D), or None.
        iterations: power iterations (30 agree with 100 to ~1% on an MLP).
        seed: the start vector's seed.
    """
    scale = scale or [tf.ones_like(v) for v in variables]

    def unit(u):
        norm = tf.sqrt(_dot(u, u))
        return [x / norm for x in u]

    u = unit([tf.random.stateless_normal(v.shape, [seed, i]) for i, v in enumerate(variables)])
    eigenvalue = tf.constant(0.0)
    for _ in tf.range(iterations):
        hu = hessian_vector_product(loss_fn, variables, [d * x for d, x in zip(scale, u)])
        dhdu = [d * x for d, x in zip(scale, hu)]
        eigenvalue = _dot(u, dhdu)
        u = unit(dhdu)
    return eigenvalue


def adam_preconditioner(optimizer: Any, epsilon: float | None = None) -> list[tf.Tensor]:
    """P^-1/2 = 1 / sqrt(sqrt(v_hat) + epsilon) from a built Adam's second moments.

    v_hat = v / (1 - beta_2**t), t the updates (micro-steps for
    `UpdateAccumulationAdam`), or v / (1 - P_2) under a `scaling_rule`.

    Args:
        optimizer: a built `keras.optimizers.Adam`, `InvariantAdam`,
            `UpdateAccumulationAdam` or `GradientAccumulation` of Adam.
        epsilon: the epsilon added to sqrt(v_hat); default the optimizer's.

    Returns:
        P^-1/2 per trainable variable: `preconditioned_sharpness`'s `scale`.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    velocities = _compat.adam_velocities(optimizer)
    if not velocities or not hasattr(optimizer, "beta_2"):
        raise ValueError(
            "adam_preconditioner needs a built Adam, InvariantAdam or a "
            f"GradientAccumulation of Adam. Received: optimizer={optimizer!r}"
        )
    products = getattr(optimizer, "_beta_products", None)
    if getattr(optimizer, "scaling_rule", None) is not None and products:
        correction = 1 - ops.cast(products[1], "float32")
    else:
        # t: the counter v moves with (`UpdateAccumulationAdam` names its own).
        counter = getattr(optimizer, "_moments_counter", "iterations")
        t = ops.cast(getattr(optimizer, counter), "float32")
        correction = 1 - ops.power(float(optimizer.beta_2), t)
    epsilon = optimizer.epsilon if epsilon is None else epsilon
    # keras.ops: every backend (the "adam_preconditioned" noise estimate uses it).
    return [
        1 / ops.sqrt(ops.sqrt(ops.convert_to_tensor(v) / ops.cast(correction, v.dtype)) + epsilon)
        for v in velocities
    ]
