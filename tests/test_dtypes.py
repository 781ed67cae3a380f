"""`steps=1` of both Adam variants is `keras.optimizers.Adam` in every
dtype Keras Adam takes: float32, float16 and bfloat16 variables (with
`state_dtype=None`: moments in the variable's dtype, as Keras keeps them),
and float32 variables under the mixed_float16 policy; with float32 state
(the default) a bfloat16 variable trains the same in graph mode and under
XLA as eagerly (tests/backends/test_low_precision.py: against numpy)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka

VARIANTS = [ka.UpdateAccumulationAdam, ka.InvariantAdam]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_1_is_keras_adam_in_every_dtype(variant, dtype, graph):
    rng = np.random.default_rng(3)
    init = rng.normal(size=(3, 4)).astype("float32")
    ours = keras.Variable(init, dtype=dtype)
    theirs = keras.Variable(init, dtype=dtype)
    opt, ref = variant(1e-2, steps=1, state_dtype=None), keras.optimizers.Adam(1e-2)
    opt.build([ours])
    ref.build([theirs])

    def step(g):
        opt.apply([tf.cast(g, dtype)], [ours])
        ref.apply([tf.cast(g, dtype)], [theirs])

    if graph:
        step = tf.function(step)
    for _ in range(6):
        step(tf.constant(rng.normal(size=(3, 4)), "float32"))
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(ours).astype("float32"),
            keras.ops.convert_to_numpy(theirs).astype("float32"),
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_beta_2_rounds_to_one_as_in_keras(variant):
    # The outside trial: four steps of gradient 1 from 0 at lr 1e-4. In
    # bfloat16 beta_2 = 0.999 rounds to 1, so Keras's alpha, and its step,
    # are 0; 0.2.0's UpdateAccumulationAdam moved by -4e-4 (alpha in float32).
    ours = keras.Variable(np.zeros(2), dtype="bfloat16")
    theirs = keras.Variable(np.zeros(2), dtype="bfloat16")
    opt, ref = variant(1e-4, steps=1, state_dtype=None), keras.optimizers.Adam(1e-4)
    for _ in range(4):
        opt.apply([tf.ones(2, "bfloat16")], [ours])
        ref.apply([tf.ones(2, "bfloat16")], [theirs])
    expected = keras.ops.convert_to_numpy(theirs).astype("float32")
    np.testing.assert_array_equal(expected, [0.0, 0.0])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours).astype("float32"), expected)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_state_of_bfloat16_is_the_same_compiled(variant, steps):
    # The TensorFlow forms' kernels (graph mode, one compiled kernel per
    # replica under XLA, a wide variable to make them compile) against the
    # eager run, which tests/backends/test_low_precision.py checks against
    # numpy. Before float32 state, InvariantAdam moved nothing here.
    rng = np.random.default_rng(5)
    init = rng.normal(size=(64, 80)).astype("float32")
    grads = [tf.constant(rng.normal(size=(64, 80)), "bfloat16") for _ in range(2 * steps)]
    results = []
    for mode in ("eager", "graph", "xla"):
        var = keras.Variable(init, dtype="bfloat16")
        opt = variant(1e-2, steps=steps, weight_decay=0.1)
        opt.build([var])
        step = functools.partial(_apply, opt, var)
        if mode != "eager":
            step = tf.function(step, jit_compile=mode == "xla")
        for g in grads:
            step(g)
        results.append(keras.ops.convert_to_numpy(var).astype("float32"))
    assert np.max(np.abs(results[0] - init)) > 0.005
    np.testing.assert_array_equal(results[1], results[0])
    # XLA fuses the float32 arithmetic otherwise: one bfloat16 spacing.
    np.testing.assert_allclose(results[2], results[0], rtol=2.0**-7, atol=0)


def _apply(optimizer, variable, grad):
    optimizer.apply([grad], [variable])


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_1_is_keras_adam_under_mixed_float16(variant):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 6)).astype("float32")
        y = rng.normal(size=(64, 1)).astype("float32")
        weights = []
        for optimizer in (variant(1e-2, steps=1), keras.optimizers.Adam(1e-2)):
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(8, "relu"),
                    keras.layers.Dense(1, dtype="float32"),
                ]
            )
            model.compile(optimizer=optimizer, loss="mse")
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            weights.append([w.numpy() for w in model.weights])
        for ours, theirs in zip(*weights):
            np.testing.assert_array_equal(ours, theirs)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_state_of_bfloat16_under_mirrored_strategy_is_one_device(variant):
    # 2 replicas x micro-batches of 8 (global 16): InvariantAdam's kappa =
    # 2 x 2 against one device's steps=4 over the same halves;
    # UpdateAccumulationAdam's moments see the global micro-batch, as one
    # device at batches of 16. Float32 moments, replica-local or mirrored.
    from conftest import mirrored_strategy

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")  # one window: one bfloat16 write
    y = rng.normal(size=(32, 1)).astype("float32")

    def fitted(strategy, steps, batch_size):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer=variant(2e-2, steps=steps), loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        assert {str(m.dtype) for m in model.optimizer._momentums} == {"float32"}
        return [np.asarray(w, "float32") for w in model.get_weights()]

    keras.config.set_dtype_policy("bfloat16")
    try:
        ours = fitted(mirrored_strategy(), 2, 16)
        if variant is ka.InvariantAdam:
            one = fitted(tf.distribute.get_strategy(), 4, 8)
        else:
            one = fitted(tf.distribute.get_strategy(), 2, 16)
    finally:
        keras.config.set_dtype_policy("float32")
    for a, b in zip(ours, one):
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=0)  # one bfloat16 spacing
