"""UpdateAccumulationAdam: numpy reference and Keras Adam at steps = 1."""

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka


@pytest.mark.parametrize("steps", [1, 3])
def test_matches_numpy_reference(steps):
    # Loss 0.5 |theta - target_t|^2 per micro-batch: g = theta - target_t,
    # taken at the stale theta of the window.
    rng = np.random.default_rng(steps)
    targets = rng.normal(size=(4 * steps, 6))
    theta = [rng.normal(size=6)]
    reference = references.UpdateAccumulationAdam(0.05, steps)
    var = keras.Variable(theta[0].astype("float32"))
    opt = ka.UpdateAccumulationAdam(0.05, steps=steps)
    for target in targets:
        opt.apply([var - target.astype("float32")], [var])
        theta = reference.apply(theta, [theta[0] - target])
        np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-5)
    assert int(opt.iterations) == 4


def test_steps_1_is_keras_adam_bit_for_bit():
    rng = np.random.default_rng(0)
    init = rng.normal(size=(5,)).astype("float32")
    ours, theirs = keras.Variable(init), keras.Variable(init)
    opt = ka.UpdateAccumulationAdam(0.01)
    ref = keras.optimizers.Adam(0.01)
    for _ in range(10):
        g = tf.constant(rng.normal(size=5), "float32")
        opt.apply([g], [ours])
        ref.apply([g], [theirs])
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_one_extra_buffer_only_when_accumulating():
    var = keras.Variable(np.zeros(7, "float32"))
    for steps, slots in [(1, 2), (4, 3)]:
        opt = ka.UpdateAccumulationAdam(steps=steps)
        opt.build([var])
        assert sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape)) == slots * 7


def test_skip_window_keeps_theta_and_moments_finite():
    var = keras.Variable(np.ones(2, "float32"))
    opt = ka.UpdateAccumulationAdam(0.1, steps=2, nonfinite="skip_window")
    opt.apply([tf.constant([1.0, 1.0])], [var])
    opt.apply([tf.constant([np.nan, 1.0])], [var])
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert int(opt.skipped_updates) == 1
    assert int(opt.skipped_micro_batches.numpy()) == 1
    assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables)
    # The next window applies normally.
    opt.apply([tf.constant([1.0, 1.0])], [var])
    opt.apply([tf.constant([1.0, 1.0])], [var])
    assert np.all(var.numpy() < 1.0) and int(opt.iterations) == 1


def test_skip_micro_batch_leaves_moments_untouched():
    var = keras.Variable(np.ones(2, "float32"))
    opt = ka.UpdateAccumulationAdam(0.1, steps=2)
    opt.apply([tf.constant([1.0, 1.0])], [var])
    moments = [v.numpy().copy() for v in opt._momentums + opt._velocities]
    opt.apply([tf.constant([np.inf, 1.0])], [var])
    for before, after in zip(moments, opt._momentums + opt._velocities):
        np.testing.assert_array_equal(after.numpy(), before)
    assert int(opt.skipped_micro_batches.numpy()) == 1
    assert int(opt.iterations) == 1  # the window's one good step applied


@pytest.mark.parametrize("skipped", [0, 1, 3, 4])
def test_skipped_micro_batch_leaves_the_state_of_the_window_without_it(skipped):
    # One parameter, g = 1 + micro-step index; micro-step `skipped` is NaN.
    # Skipping the first of a window (0 or 4) must not leave the previous
    # window's update A in place (a stale update).
    var = keras.Variable(np.zeros(1, "float32"))
    opt = ka.UpdateAccumulationAdam(0.1, steps=4)
    reference = references.UpdateAccumulationAdam(0.1, 4)
    theta = [np.zeros(1)]
    for j in range(8):
        g = np.array([np.nan if j == skipped else 1.0 + j])
        opt.apply([tf.constant(g, "float32")], [var])
        theta = reference.apply(theta, [g])
        np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-6)
    assert int(opt.skipped_micro_batches.numpy()) == 1
    assert int(opt.iterations) == 2


def test_same_gradient_tensor_from_every_replica():
    # Each replica hands in the same tensor: it is each replica's share, so
    # the micro-step gradient is replicas x g (what per-replica values give).
    strategy = mirrored_strategy()
    with strategy.scope():
        var = keras.Variable(np.zeros(3, "float32"))
        opt = ka.UpdateAccumulationAdam(0.1, steps=2)
        opt.build([var])
    g = tf.constant([1.0, -2.0, 3.0])

    @tf.function
    def step():
        strategy.run(lambda: opt.apply([g], [var]))

    for _ in range(2):
        step()
    reference = references.UpdateAccumulationAdam(0.1, 2)
    theta = [np.zeros(3)]
    for _ in range(2):
        theta = reference.apply(theta, [2 * g.numpy().astype("float64")])
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-6)
