"""keras_accum.sharpness against numpy and Keras: power iteration on a known
quadratic, the stability constants, and the preconditioner against the step
Keras's Adam really takes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka
from keras_accum import sharpness


def test_power_iteration_matches_numpy_on_a_quadratic():
    """loss = w.H w / 2 has Hessian H; with P = diag(p), D = P^-1/2, the top
    eigenvalue of D H D is that of P^-1 H (numpy's, non-symmetric)."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    h = (q * [10.0, 4.0, 2.0, 1.0, 0.5, -0.3]) @ q.T  # one negative direction
    p = rng.uniform(0.2, 3.0, size=6)
    w = tf.Variable(rng.normal(size=6).astype("float32"))
    h_tf = tf.constant(h, "float32")
    loss = lambda: 0.5 * tf.reduce_sum(w * tf.linalg.matvec(h_tf, w))
    expected = max(np.linalg.eigvals(np.diag(1 / p) @ h).real)
    scale = [tf.constant(1 / np.sqrt(p), "float32")]
    top = sharpness.preconditioned_sharpness(loss, [w], scale, iterations=200)
    assert float(top) == pytest.approx(expected, rel=1e-4)
    plain = sharpness.preconditioned_sharpness(loss, [w], [tf.ones(6)], iterations=200)
    assert float(plain) == pytest.approx(10.0, rel=1e-4)


@pytest.mark.parametrize(
    "kappa,rule,expected",
    [
        (1, "invariant", 3.8 / 0.1),  # (2 + 2 x 0.9) / (1 - 0.9)
        (8, "invariant", 2.4 / 0.8 / 8),  # beta_1 = 1 - 8 x 0.1 = 0.2
        (8, "power", (2 + 2 * 0.9**8) / (1 - 0.9**8) / 8),
        (8, "fixed_beta_1", 38 / 8),
    ],
)
def test_threshold_times_lr(kappa, rule, expected):
    assert sharpness.threshold_times_lr(kappa, rule) == pytest.approx(expected, rel=1e-12)


def _adam_steps(optimizer, rng, count=5):
    var = keras.Variable(rng.normal(size=(3, 2)).astype("float32"))
    optimizer.build([var])
    for _ in range(count):
        optimizer.apply([tf.constant(rng.normal(size=(3, 2)), "float32")], [var])
    return var


def test_adam_preconditioner_is_the_step_keras_adam_takes():
    # With epsilon = 0, Adam's step is lr / (1 - beta_1**t) * P^-1 m:
    # P^-1 = scale**2, from the v after the step.
    rng = np.random.default_rng(0)
    adam = keras.optimizers.Adam(0.01, epsilon=0.0)
    var = _adam_steps(adam, rng)
    before = var.numpy()
    adam.apply([tf.constant(rng.normal(size=(3, 2)), "float32")], [var])
    [scale] = sharpness.adam_preconditioner(adam)
    t = int(adam.iterations)
    expected = -0.01 / (1 - 0.9**t) * scale.numpy() ** 2 * adam._momentums[0].numpy()
    np.testing.assert_allclose(var.numpy() - before, expected, rtol=1e-4, atol=1e-7)


def test_adam_preconditioner_of_the_wrappers():
    # InvariantAdam's rule: v_hat from the products P_2 it applied, equal to
    # the scaled optimizer's beta_2 ** t; GradientAccumulation: its Adam's.
    ours = ka.InvariantAdam(0.01, steps=4, scaling_rule="power")
    scaled = ka.InvariantAdam(steps=4, **ka.scale_hyperparameters(4, "power", 0.01))
    for opt in (ours, scaled):
        _adam_steps(opt, np.random.default_rng(1), count=12)
    a, b = (sharpness.adam_preconditioner(o)[0].numpy() for o in (ours, scaled))
    np.testing.assert_allclose(a, b, rtol=1e-5)
    wrapped = ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2)
    _adam_steps(wrapped, np.random.default_rng(2))
    [inner] = sharpness.adam_preconditioner(wrapped.inner_optimizer)
    np.testing.assert_array_equal(sharpness.adam_preconditioner(wrapped)[0].numpy(), inner)
    with pytest.raises(ValueError, match="optimizer=<keras.src.optimizers.sgd.SGD"):
        sharpness.adam_preconditioner(keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("name,value", [("learning_rate", 0.0), ("beta_1", 1.0)])
def test_stability_threshold_refuses_bad_arguments(name, value):
    arguments = {"learning_rate": 0.1, "beta_1": 0.9, name: value}
    with pytest.raises(ValueError, match=f"Received: {name}={value!r}"):
        sharpness.stability_threshold(**arguments)


def test_adam_preconditioner_of_update_accumulation_counts_micro_steps():
    # Its v moves every micro-batch: t in v_hat = v / (1 - beta_2**t) is the
    # micro-step (6), not the update count (1).
    rng = np.random.default_rng(3)
    opt = ka.UpdateAccumulationAdam(0.01, steps=4, epsilon=1e-3)
    var = keras.Variable(rng.normal(size=(3, 2)).astype("float32"))
    opt.build([var])
    v = np.zeros((3, 2))
    for _ in range(6):
        grad = rng.normal(size=(3, 2)).astype("float32")
        opt.apply([tf.constant(grad)], [var])
        v = 0.999 * v + 0.001 * grad.astype("float64") ** 2
    assert (int(opt.micro_step), int(opt.iterations)) == (6, 1)
    [scale] = sharpness.adam_preconditioner(opt)
    expected = 1 / np.sqrt(np.sqrt(v / (1 - 0.999**6)) + 1e-3)
    np.testing.assert_allclose(scale.numpy(), expected, rtol=1e-5)
