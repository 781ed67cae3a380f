"""InvariantAdam: numpy reference, Keras Adam at kappa = 1, invariance."""

import keras
import numpy as np
import pytest
import references
import tensorflow as tf

import keras_accum as ka


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_matches_numpy_reference(steps):
    rng = np.random.default_rng(steps)
    windows = [rng.normal(size=(steps, 3, 2)) for _ in range(5)]
    theta = [rng.normal(size=(3, 2))]
    var = keras.Variable(theta[0].astype("float32"))
    opt = ka.InvariantAdam(0.05, beta_1=0.8, beta_2=0.95, steps=steps)
    reference = references.InvariantAdam(0.05, steps, b1=0.8, b2=0.95)
    for window in windows:
        for j, g in enumerate(window):
            before = var.numpy().copy()
            opt.apply([tf.constant(g, "float32")], [var])
            theta = reference.apply(theta, [g])
            if j < steps - 1:  # no movement inside a window, bit for bit
                np.testing.assert_array_equal(var.numpy(), before)
        np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-6)
    assert int(opt.iterations) == 5 and int(opt.micro_step) == 5 * steps


def test_single_step_by_hand():
    # Window of g = 1 and g = 3: m = 0.1 * 2, v = 0.001 * (1 + 9) / 2; k = 1.
    var = keras.Variable(np.zeros(1, "float32"))
    opt = ka.InvariantAdam(0.1, steps=2)
    opt.apply([tf.constant([1.0])], [var])
    opt.apply([tf.constant([3.0])], [var])
    m, v = 0.2, 0.005
    alpha = 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9)
    # rtol: 1 - beta_2**k in float32 (as Keras Adam computes it) carries a
    # relative error of ~1e-5 at k = 1.
    np.testing.assert_allclose(var.numpy(), [-alpha * m / (np.sqrt(v) + 1e-7)], rtol=2e-5)
    # Standard accumulation would have used v = 0.001 * 2**2 instead.
    assert abs(var.numpy()[0] + alpha * m / np.sqrt(0.004)) > 1e-3


def test_kappa_1_is_keras_adam_bit_for_bit():
    rng = np.random.default_rng(0)
    init = rng.normal(size=(4, 3)).astype("float32")
    ours, theirs = keras.Variable(init), keras.Variable(init)
    opt = ka.InvariantAdam(0.01, weight_decay=0.1)
    ref = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    for _ in range(10):
        g = tf.constant(rng.normal(size=(4, 3)), "float32")
        opt.apply([g], [ours])
        ref.apply([g], [theirs])
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_uses_only_adams_two_slots_per_parameter():
    var = keras.Variable(np.zeros((10, 10), "float32"))
    opt = ka.InvariantAdam(steps=8)
    opt.build([var])
    per_param = sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape)) / 100
    assert per_param == 2


def test_v_sees_gradient_noise_not_batch_size():
    # E[mean(g^2)] does not depend on kappa; E[(mean g)^2] does. After one
    # window from zero state with beta_2 -> the window average itself,
    # v is the mean of squares whatever the number of micro-batches.
    rng = np.random.default_rng(5)
    values = {}
    for steps in (1, 4, 16):
        var = keras.Variable(np.zeros(2000, "float32"))
        opt = ka.InvariantAdam(1e-9, beta_2=0.0, steps=steps)
        for _ in range(steps):
            opt.apply([tf.constant(rng.normal(1.0, 2.0, 2000), "float32")], [var])
        values[steps] = float(np.mean(opt._velocities[0].numpy()))
    # |G|^2 + sigma^2 = 1 + 4 for every kappa (sampling error ~2%).
    for steps, value in values.items():
        assert abs(value - 5.0) < 0.35, (steps, value)


def test_skipped_micro_batch_counts_as_zero_gradient():
    var = keras.Variable(np.zeros(2, "float32"))
    opt = ka.InvariantAdam(0.1, steps=2)
    opt.apply([tf.constant([np.nan, 1.0])], [var])
    opt.apply([tf.constant([2.0, 2.0])], [var])
    reference = references.InvariantAdam(0.1, 2)
    theta = [np.zeros(2)]
    for g in ([0.0, 0.0], [2.0, 2.0]):  # the skipped one as zeros
        theta = reference.apply(theta, [np.array(g)])
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=2e-5)
    assert int(opt.skipped_micro_batches.numpy()) == 1
    assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables)


def test_raise_policy():
    var = keras.Variable(np.zeros(2, "float32"))
    opt = ka.InvariantAdam(0.1, steps=2, nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        opt.apply([tf.constant([np.inf, 1.0])], [var])


@pytest.mark.parametrize("skipped", [0, 2, 3])
def test_skipped_first_micro_batch_of_a_window_is_a_zero_gradient(skipped):
    var = keras.Variable(np.zeros(2, "float32"))
    opt = ka.InvariantAdam(0.1, steps=3)
    reference = references.InvariantAdam(0.1, 3)
    theta = [np.zeros(2)]
    for j in range(6):
        g = np.full(2, np.inf if j == skipped else 1.0 + j)
        opt.apply([tf.constant(g, "float32")], [var])
        theta = reference.apply(theta, [g])
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=2e-5, atol=1e-6)
    assert int(opt.skipped_micro_batches.numpy()) == 1
