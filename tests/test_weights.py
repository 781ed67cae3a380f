"""A micro-batch weight is used or refused, never silently dropped.

`GradientAccumulation` weighs micro-batches by item counts; the two Adam
variants average them equally, and refuse a weight (as an argument or
through `weigh_micro_batches`) with an error that says so.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka

ADAM_VARIANTS = {
    "invariant_adam": lambda: ka.InvariantAdam(0.1, steps=2),
    "update_accumulation_adam": lambda: ka.UpdateAccumulationAdam(0.1, steps=2),
}


@pytest.mark.parametrize("name", sorted(ADAM_VARIANTS))
@pytest.mark.parametrize("weight", [3.0, 1, tf.constant(2.0)], ids=["float", "int", "tensor"])
def test_adam_variants_refuse_a_weight(name, weight):
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = ADAM_VARIANTS[name]()
    with pytest.raises(ValueError, match=r"`weight` is not used by .*Adam.*Received: weight="):
        optimizer.apply([tf.ones(2)], [variable], weight=weight)
    np.testing.assert_array_equal(variable.numpy(), np.ones(2))


def _model(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("name", sorted(ADAM_VARIANTS))
def test_weigh_micro_batches_refuses_an_adam_variant(name):
    with pytest.raises(ValueError, match=r"`weigh_micro_batches` has no effect with .*Adam"):
        ka.weigh_micro_batches(_model(ADAM_VARIANTS[name]()))


@pytest.mark.parametrize("name", sorted(ADAM_VARIANTS))
def test_weighed_model_recompiled_with_an_adam_variant_trains_as_never_weighed(name):
    # 0.2.0 refused it at the first step, and only a new model got out: the
    # weighing belongs to one compile, and a later compile drops it.
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    y = np.ones((8, 1), "float32")
    weights = []
    for weighed in (True, False):
        keras.utils.set_random_seed(0)
        model = _model(ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2))
        if weighed:
            ka.weigh_micro_batches(model)
        model.compile(optimizer=ADAM_VARIANTS[name](), loss="mse")
        model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_weigh_micro_batches_leaves_a_keras_optimizer_as_it_is():
    # One update per batch: the batch mean is already exact.
    model = _model(keras.optimizers.SGD(0.1))
    compiled = model._compile_loss
    assert ka.weigh_micro_batches(model) is model and model._compile_loss is compiled


def test_gradient_accumulation_uses_the_weight():
    # Gradients 1 and 4 with weights 3 and 1: the window mean is 7/4, not 5/2.
    variable = keras.Variable(np.zeros(1, "float32"))
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=2)
    optimizer.apply([tf.constant([1.0])], [variable], weight=3.0)
    optimizer.apply([tf.constant([4.0])], [variable], weight=1.0)
    np.testing.assert_allclose(variable.numpy(), [-7.0 / 4.0])
