"""keras_accum.experiments.models: each model builds, trains a step, is deterministic."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_accum.experiments import models

# name, input shape, kwargs, a batch of 4 inputs.
CASES = [
    ("mlp", (40,), {}, lambda: np.random.randn(4, 40)),
    ("cnn", (40,), {}, lambda: np.random.randn(4, 40)),
    (
        "resnet",
        (28, 28, 1),
        {"width": 8, "blocks_per_stage": 1},
        lambda: np.random.rand(4, 28, 28, 1),
    ),
    (
        "transformer",
        (16,),
        {"vocab_size": 12},
        lambda: np.random.randint(0, 12, (4, 16)).astype(np.int32),
    ),
]


@pytest.mark.parametrize("name,shape,kwargs,inputs", CASES, ids=[c[0] for c in CASES])
def test_model_builds_and_trains(name, shape, kwargs, inputs):
    keras.utils.set_random_seed(0)
    model = models.build_model(name, shape, 10, **kwargs)
    keras.utils.set_random_seed(0)
    twin = models.build_model(name, shape, 10, **kwargs)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)

    x, y = inputs(), np.arange(4) % 10
    assert model(x).shape == (4, 10)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = model.get_weights()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_transformer_embedding_gradient_is_sparse():
    model = models.build_model("transformer", (16,), 10, vocab_size=12)
    tokens = tf.constant(np.random.randint(0, 12, (4, 16)), tf.int32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tokens))
    embeddings = model.get_layer("token_embedding").embeddings
    assert isinstance(tape.gradient(loss, embeddings), tf.IndexedSlices)


def test_unknown_model_lists_valid_names():
    with pytest.raises(
        ValueError, match=("Unknown model 'foo'. Valid: cnn, mlp, resnet, transformer")
    ):
        models.build_model("foo", (40,), 10)
