"""`steps=1` of both Adam variants is `keras.optimizers.Adam` in every
dtype Keras Adam takes: float32, float16 and bfloat16 variables, and
float32 variables under the mixed_float16 policy."""

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
    opt, ref = variant(1e-2, steps=1), keras.optimizers.Adam(1e-2)
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
    opt, ref = variant(1e-4, steps=1), keras.optimizers.Adam(1e-4)
    for _ in range(4):
        opt.apply([tf.ones(2, "bfloat16")], [ours])
        ref.apply([tf.ones(2, "bfloat16")], [theirs])
    expected = keras.ops.convert_to_numpy(theirs).astype("float32")
    np.testing.assert_array_equal(expected, [0.0, 0.0])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours).astype("float32"), expected)


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
