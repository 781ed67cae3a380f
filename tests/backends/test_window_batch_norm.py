"""`keras_accum.layers.BatchNormalization` on whichever backend Keras runs.

On TensorFlow the optimizer moves the layer's statistics at a window's end
(`on_window_end`); on JAX and PyTorch the layer counts its own training
calls and moves them in the call that ends the window. Either way, with
learning rate 0 (the layer's inputs fixed) the moving statistics are those
of Keras's layer at a batch of the whole window, and the layer's whole
state (moving statistics, and the sums S1, S2, N of the window in
progress) is that of the float64 reference (tests/references.py).
"""

import os

import keras
import numpy as np
import pytest
import references as ref

import keras_accum as ka

BACKEND = keras.backend.backend()
# Batch renormalization came with Keras 3.14.
HAS_RENORM = "renorm" in keras.layers.BatchNormalization().get_config()

RNG = np.random.default_rng(0)
# Mean 1, spread 2: a shift the sums must not lose.
X = RNG.normal(1.0, 2.0, size=(48, 6, 2)).astype("float32")
Y = RNG.normal(size=(48, 1)).astype("float32")
K, B = 3, 4  # micro-batches per window, items per micro-batch
MOMENTUM = 0.5  # moves far in a few updates: a wrong update shows

FROZEN = {  # learning rate 0: the layer's inputs stay as they are
    "gradient_accumulation": lambda steps, **kw: ka.GradientAccumulation(
        keras.optimizers.SGD(0.0), steps=steps, **kw
    ),
    "update_accumulation_adam": lambda steps, **kw: ka.UpdateAccumulationAdam(
        0.0, steps=steps, **kw
    ),
    "invariant_adam": lambda steps, **kw: ka.InvariantAdam(0.0, steps=steps, **kw),
}


def build(layer=ka.layers.BatchNormalization, momentum=MOMENTUM, **kwargs):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6, 2)),
            keras.layers.Conv1D(3, 3),
            layer(momentum=momentum, **kwargs),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


def fit(model, optimizer, batch_size, x=X, y=Y, epochs=1):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def numpy(value):
    return keras.ops.convert_to_numpy(value)


def moving(model):
    layer = model.layers[1]
    return numpy(layer.moving_mean), numpy(layer.moving_variance)


def state(model):
    """(moving mean, moving variance, S1, S2, N) of the model's layer."""
    layer = model.layers[1]
    sums = (layer.window_sum, layer.window_square_sum, layer.window_count)
    return moving(model) + tuple(numpy(s) for s in sums)


def features(model, x):
    """The layer's inputs (float64): the model before it, weights fixed."""
    return numpy(model.layers[0](x)).astype("float64")


def micro_batches(x, size, epochs=1):
    """What `fit(batch_size=size, shuffle=False)` feeds, in order."""
    return [x[i : i + size] for _ in range(epochs) for i in range(0, len(x), size)]


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def assert_counts_agree(model):
    """The layer's micro-step is the optimizer's (on TensorFlow the
    optimizer's count, written into the layer after each `apply`)."""
    assert int(numpy(model.layers[1].micro_step)) == int(numpy(model.optimizer.micro_step))


@pytest.mark.parametrize("name", FROZEN)
def test_moving_statistics_are_keras_at_the_big_batch(name):
    model = fit(build(momentum_unit="update"), FROZEN[name](K), B)
    keras_model = fit(build(keras.layers.BatchNormalization), keras.optimizers.SGD(0.0), K * B)
    assert_close(moving(model), moving(keras_model))
    assert int(numpy(model.optimizer.iterations)) == len(X) // (K * B)
    np.testing.assert_array_equal(numpy(model.layers[1].window_count), 0.0)
    assert_counts_agree(model)


def test_default_momentum_is_per_micro_step():
    # momentum m per micro-step: one update moves as Keras's layer at the
    # big batch with momentum m ** K, the horizon of Keras's layer under
    # accumulation in examples.
    model = fit(build(), FROZEN["gradient_accumulation"](K), B)
    assert model.layers[1].momentum_unit == "micro_step"
    keras_model = fit(
        build(keras.layers.BatchNormalization, momentum=MOMENTUM**K),
        keras.optimizers.SGD(0.0),
        K * B,
    )
    assert_close(moving(model), moving(keras_model))


@pytest.mark.skipif(not HAS_RENORM, reason="renorm=True needs Keras 3.14+")
@pytest.mark.parametrize("unit", ["micro_step", "update"])
def test_renorm_statistics_are_keras_at_the_big_batch(unit):
    # Per micro-step both momenta are raised to the window's K: Keras's
    # layer at the big batch with momentum and renorm_momentum to the K.
    power = K if unit == "micro_step" else 1
    model = fit(build(renorm=True, momentum_unit=unit), FROZEN["gradient_accumulation"](K), B)
    keras_model = fit(
        build(
            keras.layers.BatchNormalization,
            momentum=MOMENTUM**power,
            renorm=True,
            renorm_momentum=0.99**power,
        ),
        keras.optimizers.SGD(0.0),
        K * B,
    )
    names = ("moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev")
    mine, theirs = model.layers[1], keras_model.layers[1]
    assert_close(
        [numpy(getattr(mine, n)) for n in names], [numpy(getattr(theirs, n)) for n in names]
    )


def test_masked_items_are_left_out():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(7, 3, mask_zero=True),
            ka.layers.BatchNormalization(momentum=MOMENTUM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    tokens = RNG.integers(0, 7, size=(20, 5)).astype("int32")
    tokens[:, 0] = 1  # no micro-batch is all padding
    model = fit(model, FROZEN["update_accumulation_adam"](2), 3, x=tokens, y=Y[:20])
    embedded = numpy(model.layers[0](tokens)).astype("float64")
    masks = micro_batches(tokens != 0, 3)
    expected = ref.window_batch_norm_state(
        micro_batches(embedded, 3), [2] * 4, MOMENTUM, 0.0, 1.0, "micro_step", masks
    )
    assert_close(state(model), expected)  # 7 micro-batches: the last window in progress
    assert_counts_agree(model)


@pytest.mark.parametrize("unit", ["micro_step", "update"])
def test_state_over_unequal_windows_matches_the_reference(unit):
    # 22 items in micro-batches of 4: 4, 4, 4, 4, 4, 2 per epoch; windows of
    # 3 across the two epochs and 2 more micro-batches: 14 in all, the last
    # window in progress (its sums checked too).
    x, y = X[:22], Y[:22]
    model = fit(build(momentum_unit=unit), FROZEN["invariant_adam"](K), B, x=x, y=y, epochs=2)
    model.fit(x[:8], y[:8], batch_size=B, shuffle=False, verbose=0)
    batches = micro_batches(features(model, x), B, epochs=2) + micro_batches(
        features(model, x[:8]), B
    )
    expected = ref.window_batch_norm_state(batches, [K] * 5, MOMENTUM, 0.0, 1.0, unit)
    assert expected[4][0] == 2 * B * 4  # 2 micro-batches of 4 items x 4 positions
    assert_close(state(model), expected)
    assert_counts_agree(model)


@pytest.mark.parametrize("unit", ["micro_step", "update"])
def test_piecewise_windows_of_one_two_and_four(unit):
    steps = ka.PiecewiseSteps([1, 3], [1, 2, 4])  # windows 1, 2, 4, 4, ...
    optimizer = FROZEN["gradient_accumulation"](steps)
    model = fit(build(momentum_unit=unit), optimizer, B, X[:44], Y[:44])
    batches = micro_batches(features(model, X[:44]), B)  # 11: the last 4-window holds 4
    expected = ref.window_batch_norm_state(batches, [1, 2, 4, 4], MOMENTUM, 0.0, 1.0, unit)
    assert_close(state(model), expected)
    assert int(numpy(model.optimizer.iterations)) == 4
    assert_counts_agree(model)


def test_a_skipped_micro_batch_is_counted_by_both():
    # A NaN target makes micro-batch 4's gradient NaN: the optimizer skips
    # it and still counts it; the layer folds its (finite) inputs, as on
    # TensorFlow, and its windows stay the optimizer's.
    y = Y[:36].copy()
    y[4 * B] = np.nan
    optimizer = FROZEN["update_accumulation_adam"](K, nonfinite="skip_micro_batch")
    model = fit(build(), optimizer, B, X[:36], y)
    assert int(numpy(model.optimizer.skipped_micro_batches)) == 1
    batches = micro_batches(features(model, X[:36]), B)
    expected = ref.window_batch_norm_state(batches, [K] * 3, MOMENTUM, 0.0, 1.0, "micro_step")
    assert_close(state(model), expected)
    assert_counts_agree(model)


def test_save_mid_window_and_load_resumes_exactly(tmp_path):
    def run(model, x, y):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    def make():  # weights move too; windows of 1, then 4
        return ka.InvariantAdam(0.01, steps=ka.PiecewiseSteps([2], [1, 4]))

    whole = build()
    whole.compile(optimizer=make(), loss="mse")
    run(whole, X[:40], Y[:40])

    model = build()
    model.compile(optimizer=make(), loss="mse")
    run(model, X[:32], Y[:32])  # 8 micro-batches: 1, 1, 4, then 2 into a window
    assert numpy(model.layers[1].window_count)[0] == 2 * B * 4  # 4 positions
    path = str(tmp_path / "mid_window.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored.layers[1]) is ka.layers.BatchNormalization
    assert restored.layers[1].momentum_unit == "micro_step"
    assert_counts_agree(restored)
    run(restored, X[32:40], Y[32:40])
    assert_counts_agree(restored)
    for a, b in zip(restored.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


COUNTERS = ("micro_step", "window_steps", "window_end")
OLD_FILE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "fixtures", "batch_norm_without_counters"
)


def test_a_file_without_counters_loads_and_goes_on():
    # keras_accum 0.3.x's TensorFlow files hold the window's sums and no
    # counters (written as its README says, mid-window: 3 micro-batches
    # into the second window of 4). Every backend loads it, its counters
    # at 0. On TensorFlow the optimizer still ends that window; elsewhere
    # the layer's next training call starts a window of its own.
    model = keras.models.load_model(os.path.join(OLD_FILE, "model.keras"))
    layer = model.layers[1]
    expected = np.load(os.path.join(OLD_FILE, "expected.npz"))
    for name in ("moving_mean", "moving_variance", "window_sum", "window_square_sum"):
        np.testing.assert_array_equal(numpy(getattr(layer, name)), expected[name], name)
    np.testing.assert_array_equal(numpy(layer.window_count), expected["window_count"])
    assert [int(numpy(getattr(layer, name))) for name in COUNTERS] == [0, 0, 0]
    model.fit(X[:4], Y[:4], batch_size=B, shuffle=False, verbose=0)
    assert int(numpy(model.optimizer.micro_step)) == 8
    if BACKEND == "tensorflow":  # the optimizer's count: it ended the file's window
        expected = [8, 4, 8]
    else:  # its own count began a window of `steps` = 4 at this call
        expected = [1, 4, 4]
    assert [int(numpy(getattr(layer, name))) for name in COUNTERS] == expected


def test_without_an_accumulating_optimizer_it_is_keras():
    reference = fit(build(keras.layers.BatchNormalization), keras.optimizers.Adam(0.01), B)
    model = fit(build(), keras.optimizers.Adam(0.01), B)
    for mine, theirs in zip(model.layers, reference.layers):
        # Keras's variables, moving statistics included (the window's follow).
        for a, b in zip(mine.weights, theirs.weights):
            np.testing.assert_array_equal(numpy(a), numpy(b), b.name)
    np.testing.assert_array_equal(numpy(model.layers[1].window_count), 0.0)


def test_config_round_trip_and_bad_unit():
    layer = ka.layers.BatchNormalization(momentum_unit="update")
    again = ka.layers.BatchNormalization.from_config(layer.get_config())
    assert again.momentum_unit == "update"
    with pytest.raises(ValueError) as info:
        ka.layers.BatchNormalization(momentum_unit="batch")
    assert "Received: momentum_unit='batch'" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(BACKEND == "jax", reason="refused under JAX (the next test)")
@pytest.mark.parametrize("unit", ["micro_step", "update"])
def test_adaptive_windows_of_one_two_and_four(unit):
    # The schedule's size changes between fits (`observe`): windows 1, 1,
    # then 2, 2, then 4. On TensorFlow the optimizer ends the layer's
    # windows; on PyTorch the layer reads the schedule in its forward pass.
    steps = ka.AdaptiveSteps(1, 4, B, smoothing=0.0, min_observations=1)
    model = build(momentum_unit=unit)
    model.compile(optimizer=FROZEN["gradient_accumulation"](steps), loss="mse")
    seen = []
    for size, (lo, hi) in [(None, (0, 8)), (2, (8, 24)), (4, (24, 40))]:
        if size is not None:
            steps.observe(size * B)  # b_simple: `size` micro-batches of B items
        model.fit(X[lo:hi], Y[lo:hi], batch_size=B, shuffle=False, verbose=0)
        seen.append(int(numpy(model.optimizer.window_steps)))
        assert_counts_agree(model)
    assert seen == [1, 2, 4]
    assert int(numpy(model.optimizer.iterations)) == 5
    batches = micro_batches(features(model, X[:40]), B)
    expected = ref.window_batch_norm_state(batches, [1, 1, 2, 2, 4], MOMENTUM, 0.0, 1.0, unit)
    assert_close(state(model), expected)
    if BACKEND != "tensorflow":
        assert int(numpy(model.layers[1].window_end)) == 10


@pytest.mark.skipif(BACKEND != "jax", reason="TensorFlow and PyTorch follow any schedule")
def test_adaptive_steps_refused_in_one_line():
    optimizer = ka.GradientAccumulation(
        keras.optimizers.SGD(0.0), steps=ka.AdaptiveSteps(1, 4, micro_batch_size=B)
    )
    model = build()
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError) as info:
        model.fit(X[:8], Y[:8], batch_size=B, shuffle=False, verbose=0)
    # Keras wraps an error raised in a layer's call; the message is one line.
    line = next(x for x in str(info.value).splitlines() if "Received: steps=" in x)
    assert "PiecewiseSteps" in line and "Received: steps=AdaptiveSteps" in line
