"""keras_accum.layers.BatchNormalization: the window's moving statistics.

With learning rate 0 the layer's inputs do not change, so its moving
statistics under accumulation (windows of k micro-batches of b items) must
be Keras's layer's at batch k * b (float32 rounding), and those of the
float64 reference of the window equations (tests/references.py) for
unequal, masked and scheduled windows. Without an accumulating optimizer it
is Keras's layer, bit for bit.
"""

import functools

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka
from keras_accum import training

# Batch renormalization came with Keras 3.14.
HAS_RENORM = "renorm" in keras.layers.BatchNormalization().get_config()
RENORM = [False, True] if HAS_RENORM else [False]

RNG = np.random.default_rng(0)
# Mean 1, spread 2: a shift the sums must not lose.
X = RNG.normal(1.0, 2.0, size=(48, 6, 2)).astype("float32")
Y = RNG.normal(size=(48, 1)).astype("float32")
K, B = 3, 4  # micro-batches per window, items per micro-batch
MOMENTUM = 0.5  # moves far in a few updates: a wrong update shows


def build(layer=ka.layers.BatchNormalization, **kwargs):
    if layer is ka.layers.BatchNormalization:
        # Momentum per update, as Keras's layer at the big batch moves.
        kwargs.setdefault("momentum_unit", "update")
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 2)),
            keras.layers.Conv1D(3, 3),
            layer(momentum=MOMENTUM, **kwargs),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


def norm_layer(model):
    return next(x for x in model.layers if isinstance(x, keras.layers.BatchNormalization))


def moving(model):
    layer = norm_layer(model)
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def fit(model, optimizer, batch_size, x=X, y=Y, epochs=1, **compile_kwargs):
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@functools.cache
def keras_model_at(batch_size, **kwargs):
    """The model with Keras's layer trained at `batch_size` (weights fixed)."""
    model = build(keras.layers.BatchNormalization, **kwargs)
    return fit(model, keras.optimizers.SGD(0.0), batch_size)


def keras_big_batch(batch_size, **kwargs):
    """Moving statistics of Keras's layer at `batch_size` (weights fixed)."""
    return moving(keras_model_at(batch_size, **kwargs))


FROZEN = {  # learning rate 0: the layer's inputs stay as they are
    "gradient_accumulation": lambda k: ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=k),
    "update_accumulation_adam": lambda k: ka.UpdateAccumulationAdam(0.0, steps=k),
    "invariant_adam": lambda k: ka.InvariantAdam(0.0, steps=k),
}


def assert_close(actual, expected, rtol=1e-5):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-6)


def features(model, x):
    """The layer's inputs (float64): the model before it, weights fixed."""
    return keras.ops.convert_to_numpy(model.layers[0](x)).astype("float64")


def micro_batches(x, size, epochs=1):
    """What `fit(batch_size=size, shuffle=False)` feeds, in order."""
    return [x[i : i + size] for _ in range(epochs) for i in range(0, len(x), size)]


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("name", FROZEN)
def test_moving_statistics_are_keras_at_the_big_batch(name, jit):
    model = fit(build(), FROZEN[name](K), B, jit_compile=jit)
    assert_close(moving(model), keras_big_batch(K * B))
    assert int(model.optimizer.iterations) == len(X) // (K * B)
    np.testing.assert_array_equal(norm_layer(model).window_count.numpy(), 0.0)


def test_keras_layer_under_accumulation_is_not_the_big_batch():
    # What the layer fixes: Keras's moves k times per update.
    model = fit(build(keras.layers.BatchNormalization), FROZEN["gradient_accumulation"](K), B)
    gap = np.max(np.abs(moving(model)[1] - keras_big_batch(K * B)[1]))
    assert gap > 1e-2


@pytest.mark.skipif(not HAS_RENORM, reason="renorm=True needs Keras 3.14+")
def test_renorm_statistics_are_keras_at_the_big_batch():
    model = fit(build(renorm=True), FROZEN["gradient_accumulation"](K), B)
    assert_close(moving(model), keras_big_batch(K * B, renorm=True))
    layer, reference = norm_layer(model), norm_layer(keras_model_at(K * B, renorm=True))
    for name in ("moving_stddev", "renorm_mean", "renorm_stddev"):
        np.testing.assert_allclose(
            getattr(layer, name).numpy(), getattr(reference, name).numpy(), rtol=1e-5
        )


@pytest.mark.parametrize(
    "name,synchronized",
    # Keras's synchronized moments change what is folded, not how: one case.
    [
        ("gradient_accumulation", True),
        ("update_accumulation_adam", False),
        ("invariant_adam", False),
    ],
)
def test_two_replicas_are_one_device_at_the_global_window(name, synchronized):
    from keras_accum.experiments.probes import count_reductions

    strategy = mirrored_strategy()
    with strategy.scope():
        model = build(synchronized=synchronized)
        model.compile(optimizer=FROZEN[name](K), loss="mse")
    counts = {}
    with count_reductions(strategy, model.optimizer, counts):
        # Global micro-batch 2 * B (B per replica): windows of 2 * K * B items.
        model.fit(X, Y, batch_size=2 * B, shuffle=False, verbose=0)
    assert_close(moving(model), keras_big_batch(2 * K * B))
    # The layer's saved count is the optimizer's, copied in cross-replica.
    micro_steps = len(X) // (2 * B)
    counters = [int(c.numpy()) for c in norm_layer(model)._counters()]
    assert counters == [micro_steps, K, -(-micro_steps // K) * K]
    assert int(model.optimizer.micro_step.numpy()) == micro_steps
    if name == "invariant_adam":
        # Its m and v in one call, then the layer's S1, S2, N (3 x 3
        # channels) in one call: both at the window's end, none per step.
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        assert counts.get("every_step_calls", 0) == 0
        assert counts["conditional_calls"] == 2
        assert counts["conditional_elements"] == 2 * params + 3 * 3


def test_unequal_micro_batches_match_the_reference():
    # 22 items in micro-batches of 4: 4, 4, 4, 4, 4, 2 per epoch, windows of
    # 3 across the two epochs.
    x, y = X[:22], Y[:22]
    model = fit(build(), FROZEN["gradient_accumulation"](K), B, x=x, y=y, epochs=2)
    expected = references.window_batch_norm(
        micro_batches(features(model, x), B, epochs=2), [K] * 4, MOMENTUM, 0.0, 1.0
    )
    assert_close(moving(model), expected)


def test_masked_items_are_left_out():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(7, 3, mask_zero=True),
            ka.layers.BatchNormalization(momentum=MOMENTUM, momentum_unit="update"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    tokens = RNG.integers(0, 7, size=(20, 5)).astype("int32")
    tokens[:, 0] = 1  # no micro-batch is all padding
    with pytest.warns(UserWarning, match="1 of its 2 micro-batches"):  # the 7th, short
        model = fit(model, FROZEN["update_accumulation_adam"](2), 3, x=tokens, y=Y[:20])
    embedded = keras.ops.convert_to_numpy(model.layers[0](tokens)).astype("float64")
    masks = micro_batches(tokens != 0, 3)
    expected = references.window_batch_norm(
        micro_batches(embedded, 3), [2] * 3, MOMENTUM, 0.0, 1.0, masks
    )
    assert_close(moving(model), expected)


def test_piecewise_windows_of_one_two_and_four():
    steps = ka.PiecewiseSteps([1, 3], [1, 2, 4])  # windows 1, 2, 4, 4, ...
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=steps)
    model = fit(build(), optimizer, B, x=X[:44], y=Y[:44])  # 11 micro-batches
    expected = references.window_batch_norm(
        micro_batches(features(model, X[:44]), B), [1, 2, 4, 4], MOMENTUM, 0.0, 1.0
    )
    assert_close(moving(model), expected)
    assert int(model.optimizer.iterations) == 4


def test_custom_loop_trainer_follows_its_optimizer():
    model = build()  # never compiled: the Trainer attaches its optimizer
    trainer = training.Trainer(model, FROZEN["invariant_adam"](K), "mse")
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(K * B)
    iterator = iter(trainer.distribute(dataset))
    for _ in range(len(X) // (K * B)):
        trainer.train_step(iterator)
    assert_close(moving(model), keras_big_batch(K * B))


def test_save_mid_window_and_load_resumes_exactly(tmp_path):
    def run(model, x, y):  # each run ends 2 micro-batches into a window
        with pytest.warns(UserWarning, match="2 of its 4 micro-batches"):
            model.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    make = lambda: ka.InvariantAdam(0.01, steps=4)  # weights move too
    whole = build()
    whole.compile(optimizer=make(), loss="mse")
    run(whole, X[:40], Y[:40])

    model = build()
    model.compile(optimizer=make(), loss="mse")
    run(model, X[:24], Y[:24])  # 6 micro-batches: 2 into the second window
    assert norm_layer(model).window_count.numpy()[0] == 2 * B * 4  # 4 positions
    path = str(tmp_path / "mid_window.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(norm_layer(restored)) is ka.layers.BatchNormalization
    run(restored, X[24:40], Y[24:40])
    for a, b in zip(restored.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_without_an_accumulating_optimizer_it_is_keras_bit_for_bit():
    reference = build(keras.layers.BatchNormalization)
    model = ka.layers.convert_batch_normalization(reference)
    assert type(norm_layer(model)) is ka.layers.BatchNormalization
    for m in (reference, model):
        fit(m, keras.optimizers.Adam(0.01), B, epochs=2)
    mine = {v.path: v.numpy() for v in model.weights}
    for variable in reference.weights:  # Keras's variables, moving statistics included
        np.testing.assert_array_equal(mine[variable.path], variable.numpy(), variable.path)
    np.testing.assert_array_equal(model(X, training=True), reference(X, training=True))
    np.testing.assert_array_equal(model(X), reference(X))
    np.testing.assert_array_equal(norm_layer(model).window_count.numpy(), 0.0)


@pytest.mark.parametrize("renorm", RENORM)
def test_training_normalization_is_the_micro_batch_as_keras_computes_it(renorm):
    extra = {"renorm": True} if renorm else {}
    reference = keras.layers.BatchNormalization(momentum=MOMENTUM, **extra)
    layer = ka.layers.BatchNormalization(momentum=MOMENTUM, **extra)
    model = keras.Sequential([keras.Input((6, 2)), layer])
    ka.layers.attach(model, FROZEN["gradient_accumulation"](K))
    x = tf.constant(X[:B])
    np.testing.assert_array_equal(layer(x, training=True), reference(x, training=True))
    assert layer.window_count.numpy()[0] == B * 6  # folded, not moved
    np.testing.assert_array_equal(layer.moving_mean.numpy(), 0.0)


def test_mixed_precision_sums_in_float32():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # A loss scale that does not overflow: a skipped step would not
        # count as a micro-batch (the windows would shift).
        optimizer = keras.optimizers.LossScaleOptimizer(
            FROZEN["gradient_accumulation"](K), initial_scale=1.0
        )
        model = fit(build(), optimizer, B)
        expected = moving(keras_model_at.__wrapped__(K * B))  # under this policy
        layer = norm_layer(model)
        assert layer.window_sum.dtype == "float32"
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_close(moving(model), expected)


def test_convert_keeps_weights_and_predicts_identically():
    keras.utils.set_random_seed(1)
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization()]
    )
    inputs = keras.Input((3,))
    hidden = keras.layers.BatchNormalization(momentum=0.9)(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(inner(hidden)))
    for layer in model.layers[2], inner.layers[1]:  # statistics as if trained
        for variable in layer.weights:
            variable.assign(RNG.uniform(0.5, 2.0, size=variable.shape))

    converted = ka.layers.convert_batch_normalization(model)
    found = [x for x in ka.layers.attach(converted, None)]
    assert len(found) == 2 and all(type(x) is ka.layers.BatchNormalization for x in found)
    old = {v.path: v.numpy() for v in model.weights}
    for variable in converted.weights:
        if variable.path in old:
            np.testing.assert_array_equal(variable.numpy(), old[variable.path])
    assert len(converted.weights) == len(model.weights) + 2 * 6  # the window's sums, counters
    x = X[:16, :3, 0]
    np.testing.assert_array_equal(converted(x), model(x))
    assert type(model.layers[2]) is keras.layers.BatchNormalization  # model unchanged


class _Subclassed(keras.Model):
    def call(self, x):
        return x


BAD_INPUTS = {
    "convert_not_a_model": (lambda: ka.layers.convert_batch_normalization("model"), "`model`"),
    "convert_subclassed": (
        lambda: ka.layers.convert_batch_normalization(_Subclassed()),
        "Received: model=_Subclassed",
    ),
    "attach_not_a_model": (lambda: ka.layers.attach([1], None), "Received: model=[1]"),
    "attach_not_an_optimizer": (
        lambda: ka.layers.attach(build(), "adam"),
        "Received: optimizer='adam'",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_naming_it(case):
    make, words = BAD_INPUTS[case]
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert words in message and "\n" not in message
