"""A tiny transformer language model with padded sequences and a token-mean
loss: accumulated micro-batches equal the big batch in one step.

Sequences have very unequal lengths, so equal micro-batches carry unequal
token counts: the mean of micro-batch means is not the big-batch gradient
(the 2024 Hugging Face Trainer bug). `weigh_micro_batches` weights each
micro-batch by its loss denominator (unpadded tokens), summed over replicas.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka

VOCAB, LENGTH, WIDTH, ITEMS = 11, 8, 16, 16


def sequences(seed=0):
    """Token ids (0 = padding), next-token targets and the token mask."""
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.r_[np.full(8, 2), np.arange(3, LENGTH + 1, 0.75).astype(int)])
    tokens = np.zeros((ITEMS, LENGTH + 1), "int32")
    for i, n in enumerate(lengths[:ITEMS]):
        tokens[i, : n + 1] = rng.integers(1, VOCAB, n + 1)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y, (y != 0).astype("float32")


def language_model(one_hot=False):
    """Embedding, one causal self-attention block, a token classifier.

    `one_hot` embeds by a matrix product with one-hot tokens, whose gradient
    is dense: Keras clips `tf.IndexedSlices` (an Embedding's gradient) by the
    norm of their uncombined rows, so with clipping the big-batch reference
    would clip another norm than the dense window mean.
    """
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    if one_hot:
        h = keras.layers.Dense(WIDTH, use_bias=False)(keras.ops.one_hot(tokens, VOCAB))
    else:
        h = keras.layers.Embedding(VOCAB, WIDTH)(tokens)
    a = keras.layers.MultiHeadAttention(2, WIDTH // 2)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h + a)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(WIDTH, "gelu")(h))
    return keras.Model(tokens, keras.layers.Dense(VOCAB)(h))


def token_mean_loss():
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )


def fit(optimizer, batch_size, weigh=True, strategy=None, one_hot=False):
    x, y, mask = sequences()
    with (strategy or tf.distribute.get_strategy()).scope():
        model = language_model(one_hot)
        model.compile(optimizer=optimizer(), loss=token_mean_loss())
    if weigh:
        ka.weigh_micro_batches(model)
    model.fit(x, y, sample_weight=mask, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def max_difference(a, b):
    return max(np.abs(u - w).max() for u, w in zip(a.get_weights(), b.get_weights()))


@pytest.fixture(scope="module")
def big_batch():
    return fit(lambda: keras.optimizers.SGD(1.0), ITEMS)


def test_token_counts_are_unequal():
    _, _, mask = sequences()
    counts = mask.reshape(4, 4, LENGTH).sum(axis=(1, 2))
    assert counts.max() >= 1.5 * counts.min()


def test_fit_one_device_equals_the_big_batch(big_batch):
    accumulate = lambda: ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=4)
    model = fit(accumulate, 4)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_difference(model, big_batch) < 2e-6
    # Without the weighting, the mean of means is measurably off.
    assert max_difference(fit(accumulate, 4, weigh=False), big_batch) > 1e-3


def test_fit_two_replicas_equals_the_big_batch(big_batch):
    # Global batch 8 = 4 per replica; steps=2: a window of 4 micro-batches.
    accumulate = lambda: ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=2)
    model = fit(accumulate, 8, strategy=mirrored_strategy())
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_difference(model, big_batch) < 2e-6


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_mixed_float16_with_global_clipnorm(replicas):
    # Two replicas: the loss scaler calls us from threads of its own.
    strategy = mirrored_strategy() if replicas == 2 else None
    steps, batch = (4, 4) if replicas == 1 else (2, 8)

    def sgd():
        return keras.optimizers.SGD(1.0, global_clipnorm=0.5)

    def scaled(optimizer):
        # The loss scaler outside (what compile would add), started low
        # enough that the first step does not overflow float16 and is kept.
        return lambda: keras.optimizers.LossScaleOptimizer(optimizer(), initial_scale=16.0)

    accumulate = scaled(lambda: ka.GradientAccumulation(sgd(), steps=steps))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        start = language_model(one_hot=True).get_weights()
        reference = fit(scaled(sgd), ITEMS, one_hot=True)
        model = fit(accumulate, batch, strategy=strategy, one_hot=True)
        unweighted = fit(accumulate, batch, weigh=False, strategy=strategy, one_hot=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(model.optimizer.iterations.numpy()) == 1
    moved = max(np.abs(w - s).max() for w, s in zip(reference.get_weights(), start))
    # float16 activations round differently in micro-batches and the big
    # batch: compare with the size of the step, and with the unweighted error.
    error = max_difference(model, reference)
    assert error < 3e-3 * moved
    assert max_difference(unweighted, reference) > 10 * error


def test_custom_loop_equals_the_big_batch(big_batch):
    from keras_accum.training import train

    x, y, mask = sequences()
    model = language_model()
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=4)
    data = tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(ITEMS)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    train(model, optimizer, loss, data, epochs=1, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    assert max_difference(model, big_batch) < 2e-6


def test_fit_with_global_clipnorm_clips_the_window_mean():
    sgd = lambda: keras.optimizers.SGD(1.0, global_clipnorm=0.5)
    reference = fit(sgd, ITEMS, one_hot=True)
    model = fit(lambda: ka.GradientAccumulation(sgd(), steps=4), 4, one_hot=True)
    assert max_difference(model, reference) < 2e-6
