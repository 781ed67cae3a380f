"""model.fit on one device and under MirroredStrategy; save/load mid-window.

tests/conftest.py gives two logical CPUs, so the mirrored runs have two
replicas. A mirrored window of `steps` calls holds 2 * steps micro-batches;
the one-device reference is fed the same micro-batches one per call.
"""

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 5)).astype("float32")
Y = RNG.normal(size=(48, 2)).astype("float32")


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    )


def fit(make_optimizer, batch_size, strategy=None, x=X, y=Y):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model


mirrored = mirrored_strategy


CASES = {
    # name: (optimizer for one device, for two replicas, one-device batch)
    "gradient_accumulation": (
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2),
        4,
    ),
    "gradient_accumulation_clipped": (
        lambda: ka.GradientAccumulation(keras.optimizers.SGD(0.1, global_clipnorm=0.05), steps=4),
        lambda: ka.GradientAccumulation(keras.optimizers.SGD(0.1, global_clipnorm=0.05), steps=2),
        4,
    ),
    "invariant_adam": (
        lambda: ka.InvariantAdam(0.01, steps=4),
        lambda: ka.InvariantAdam(0.01, steps=2),
        4,
    ),
    # Replicas share the moments: a mirrored micro-step is the replica-mean
    # gradient of the global batch, so the reference sees global batches.
    "update_accumulation_adam": (
        lambda: ka.UpdateAccumulationAdam(0.01, steps=2),
        lambda: ka.UpdateAccumulationAdam(0.01, steps=2),
        8,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_mirrored_fit_equals_one_device(name):
    one, two, batch = CASES[name]
    reference = fit(one, batch)
    model = fit(two, 8, mirrored())
    assert model.optimizer.iterations.numpy() == 6
    assert reference.optimizer.iterations.numpy() == 6
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mirrored_invariant_adam_reduces_its_moments_in_one_call_per_window():
    # m and v are replica-local sums: the window's end all-reduces every one
    # of them in one batched call (2 x parameters), nothing every micro-step.
    from keras_accum.experiments.probes import count_reductions

    strategy = mirrored()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=ka.InvariantAdam(0.01, steps=2), loss="mse")
    counts = {}
    with count_reductions(strategy, model.optimizer, counts):
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert counts.get("every_step_calls", 0) == 0
    assert counts["conditional_calls"] == 1
    assert counts["conditional_elements"] == 2 * params


def test_mirrored_skips_non_finite_micro_batch_of_one_replica():
    x = X.copy()
    x[5] = np.nan  # second micro-batch: replica 1 of the first global batch
    policy = {"nonfinite": "skip_micro_batch"}
    one = lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4, **policy)
    two = lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2, **policy)
    reference = fit(one, 4, x=x)
    model = fit(two, 8, mirrored(), x=x)
    assert int(model.optimizer.skipped_micro_batches.numpy()) == 2  # 2 epochs
    assert int(reference.optimizer.skipped_micro_batches.numpy()) == 2
    for a, b in zip(model.get_weights(), reference.get_weights()):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mirrored_drops_the_window_of_a_non_finite_replica_by_default():
    x = X.copy()
    x[5] = np.nan  # second micro-batch: replica 1 of the first global batch
    one = lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4)
    two = lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2)
    reference = fit(one, 4, x=x)
    model = fit(two, 8, mirrored(), x=x)
    # The first window of each of the 2 epochs, on both replicas alike.
    counts = lambda opt: (int(opt.skipped_updates.numpy()), int(opt.iterations.numpy()))
    assert counts(model.optimizer) == counts(reference.optimizer) == (2, 4)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for v in model.optimizer.variables:
        assert np.all(np.isfinite(np.asarray(v))), v.path


MAKERS = {
    "gradient_accumulation": lambda: ka.GradientAccumulation(
        keras.optimizers.AdamW(0.01, weight_decay=0.01), steps=4
    ),
    "invariant_adam": lambda: ka.InvariantAdam(0.01, steps=4),
    "update_accumulation_adam": lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
}


REST = (X[8:24], Y[8:24])  # 4 micro-batches after the first 2


def saved_mid_window(name, save):
    """A model trained 2 micro-batches into a window of 4, saved there by
    `save(model)`, then trained on `REST`."""
    model = build_model()
    model.compile(optimizer=MAKERS[name](), loss="mse")
    with pytest.warns(UserWarning, match="2 of its 4 micro-batches"):
        model.fit(X[:8], Y[:8], batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.micro_step) == 2  # mid-window
    save(model)
    model.fit(*REST, batch_size=4, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", MAKERS)
def test_save_and_load_mid_window_continues_exactly(name, tmp_path):
    path = str(tmp_path / "mid_window.keras")
    model = saved_mid_window(name, lambda model: model.save(path))
    rest = REST

    restored = keras.models.load_model(path)
    assert type(restored.optimizer) is type(model.optimizer)
    assert int(restored.optimizer.micro_step) == 2
    with pytest.warns(UserWarning, match="2 of its 4 micro-batches"):  # as `model` did
        restored.fit(*rest, batch_size=4, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations) == int(model.optimizer.iterations)
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", MAKERS)
def test_load_weights_before_the_first_step_restores_the_window(name, tmp_path):
    # `load_weights` into a model compiled but not trained: the optimizer is
    # not built yet, so its saved state is restored when it is built.
    path = str(tmp_path / "mid_window.weights.h5")
    model = saved_mid_window(name, lambda model: model.save_weights(path))
    rest = REST

    fresh = build_model()
    fresh.compile(optimizer=MAKERS[name](), loss="mse")
    fresh.load_weights(path)
    assert not fresh.optimizer.built and int(fresh.optimizer.micro_step) == 0
    with pytest.warns(UserWarning, match="2 of its 4 micro-batches"):  # as `model` did
        fresh.fit(*rest, batch_size=4, shuffle=False, verbose=0)
    assert int(fresh.optimizer.micro_step) == int(model.optimizer.micro_step) == 6
    assert int(fresh.optimizer.iterations) == int(model.optimizer.iterations)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["weights.h5", "keras"])
def test_the_inner_optimizers_state_is_restored_without_a_false_alarm(kind, tmp_path, recwarn):
    # Its state is the wrapper's (restored when the wrapper is built); Keras
    # used to visit it on its own too and warn "Skipping variable loading".
    path = str(tmp_path / f"mid_window.{kind}")
    save = (lambda m: m.save_weights(path)) if kind == "weights.h5" else (lambda m: m.save(path))
    model = saved_mid_window("gradient_accumulation", save)
    inner = keras.optimizers.AdamW(0.01, weight_decay=0.01)
    if kind == "keras":
        fresh = keras.models.load_model(path)
    else:
        fresh = build_model()
        fresh.compile(optimizer=ka.GradientAccumulation(inner, steps=4), loss="mse")
        fresh.load_weights(path)
    assert not [w for w in recwarn.list if "Skipping variable loading" in str(w.message)]
    assert not set(vars(inner)) & {"load_own_variables", "assign", "assign_add", "assign_sub"}
    fresh.fit(*REST, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fresh.optimizer.get_weights(), model.optimizer.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", MAKERS)
def test_a_model_saved_before_its_first_step_loads_and_trains(name, tmp_path):
    model = build_model()
    model.compile(optimizer=MAKERS[name](), loss="mse")
    path = str(tmp_path / "untrained.keras")
    model.save(path)
    with pytest.warns(UserWarning, match="saved before its first step"):
        restored = keras.models.load_model(path)
    restored.fit(X[:16], Y[:16], batch_size=4, shuffle=False, verbose=0)
    model.fit(X[:16], Y[:16], batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_load_weights_of_another_optimizer_skips_its_state_loudly(tmp_path):
    # Layer weights saved with plain Adam, loaded into a model compiled with
    # GradientAccumulation before its first step: the layers load, the state
    # that does not fit is skipped with a warning when the optimizer is built.
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.fit(X[:8], Y[:8], batch_size=4, verbose=0)
    path = str(tmp_path / "adam.weights.h5")
    model.save_weights(path)
    other = build_model()
    other.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(), steps=4), loss="mse")
    other.load_weights(path)
    for a, b in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with (
        pytest.warns(UserWarning, match="saved state is skipped"),
        pytest.warns(UserWarning, match="2 of its 4 micro-batches"),
    ):
        other.fit(X[:8], Y[:8], batch_size=4, verbose=0)
    assert int(other.optimizer.micro_step) == 2 and int(other.optimizer.iterations) == 0


def test_loading_state_saved_with_other_steps_is_an_error(tmp_path):
    model = build_model()
    model.compile(optimizer=ka.UpdateAccumulationAdam(steps=1), loss="mse")
    model.fit(X[:8], Y[:8], batch_size=4, verbose=0)
    path = str(tmp_path / "steps1.keras")
    model.save(path)
    other = build_model()
    other.compile(optimizer=ka.UpdateAccumulationAdam(steps=4), loss="mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="saved with another `steps`"):
        other.optimizer.load_own_variables(
            {str(i): v.numpy() for i, v in enumerate(model.optimizer.variables)}
        )


@pytest.mark.parametrize("name", MAKERS)
def test_config_round_trip(name):
    optimizer = MAKERS[name]()
    config = optimizer.get_config()
    clone = type(optimizer).from_config(config)
    assert clone.get_config() == config
    serialized = keras.optimizers.serialize(optimizer)
    assert keras.optimizers.deserialize(serialized).get_config() == config


def test_config_round_trip_keeps_every_argument():
    optimizer = ka.InvariantAdam(
        learning_rate=0.003,
        beta_1=0.5,
        beta_2=0.9,
        epsilon=1e-5,
        steps=3,
        nonfinite="raise",
        weight_decay=0.2,
        name="inv",
    )
    config = optimizer.get_config()
    for key, value in dict(
        learning_rate=0.003,
        beta_1=0.5,
        beta_2=0.9,
        epsilon=1e-5,
        steps=3,
        nonfinite="raise",
        weight_decay=0.2,
        name="inv",
    ).items():
        assert (
            config[key] == pytest.approx(value)
            if isinstance(value, float)
            else config[key] == value
        )
    wrapped = ka.GradientAccumulation(
        keras.optimizers.SGD(0.5, momentum=0.7), steps=5, nonfinite="skip_window", name="ga"
    )
    clone = ka.GradientAccumulation.from_config(wrapped.get_config())
    assert (clone.steps, clone.nonfinite, clone.name) == (5, "skip_window", "ga")
    assert clone.inner_optimizer.momentum == 0.7


def big_batch_sgd_weights(x, y):
    model = build_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("replicas", [1, 2])
def test_weigh_micro_batches_makes_fit_exact_for_a_short_last_batch(replicas):
    # 14 items: one device sees micro-batches 4, 4, 4, 2; two replicas see
    # global batches 8 and 6 (4 + 4, then 3 + 3). Either way the window is
    # the whole set, which must equal one SGD step on all 14.
    x, y = X[:14], Y[:14]
    expected = big_batch_sgd_weights(x, y)
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    steps, batch = (4, 4) if replicas == 1 else (2, 8)
    results = {}
    for weigh in (True, False):
        with strategy.scope():
            model = build_model()
            model.compile(
                optimizer=ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=steps),
                loss="mse",
            )
        if weigh:
            ka.weigh_micro_batches(model)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        assert model.optimizer.iterations.numpy() == 1
        results[weigh] = model.get_weights()
    for a, b in zip(results[True], expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Without it, the mean of means: measurably different.
    assert max(np.abs(a - b).max() for a, b in zip(results[False], expected)) > 1e-4


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_weigh_micro_batches_counts_a_zero_weight_micro_batch_as_zero_items(replicas, inner):
    # 32 items, two windows of 16; items 8-15 weigh zero: one device sees
    # them as its second micro-batch of 8, two replicas as replica 1's half
    # of the first global micro-batch of 16. Under a token-mean loss they
    # add nothing to the big batch's mean, so they must add no count to the
    # window either (0.3.0 counted such a micro-batch as one item).
    x, y = X[:32], Y[:32]
    weights = np.ones(32, "float32")
    weights[8:16] = 0.0
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    make_inner = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }[inner]
    big = build_model()
    big.compile(optimizer=make_inner(), loss=loss)
    big.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    steps, batch = (2, 8) if replicas == 1 else (1, 16)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=ka.GradientAccumulation(make_inner(), steps=steps), loss=loss)
    ka.weigh_micro_batches(model)
    model.fit(x, y, sample_weight=weights, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 4
    for a, b in zip(model.get_weights(), big.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weigh_micro_batches_a_window_of_zero_weight_steps_with_a_zero_mean():
    # Every item of the first window weighs zero: its mean gradient is 0
    # (Keras divides the loss by its weight with `divide_no_nan`), not 0 / 0.
    x, y = X[:16], Y[:16]
    weights = np.concatenate([np.zeros(8, "float32"), np.ones(8, "float32")])
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    big = build_model()
    big.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    big.fit(x, y, sample_weight=weights, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = build_model()
    model.compile(
        optimizer=ka.GradientAccumulation(keras.optimizers.SGD(0.1, momentum=0.9), steps=2),
        loss=loss,
    )
    ka.weigh_micro_batches(model)
    model.fit(x, y, sample_weight=weights, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 2
    for a, b in zip(model.get_weights(), big.get_weights()):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mirrored_skip_on_one_replica_leaves_no_stale_replica_sum():
    # Window 1: all finite. Window 2: replica 1 non-finite on both calls: its
    # sum from window 1 must not enter window 2 (a stale replica sum).
    strategy = mirrored()
    with strategy.scope():
        var = keras.Variable(np.zeros(1, "float32"))
        opt = ka.GradientAccumulation(
            keras.optimizers.SGD(1.0), steps=2, nonfinite="skip_micro_batch"
        )
        opt.build([var])
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, np.nan], [6.0, np.nan]]  # [call][replica]

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply([g], [var]), args=(grads,))

    reference = references.GradientAccumulation(references.SGD(1.0), 4)
    theta = [np.zeros(1)]
    for call in values:
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx, call=call: tf.constant([call[ctx.replica_id_in_sync_group] / 2], "float32")
        )
        step(per_replica)
        for g in call:
            theta = reference.apply(theta, [np.array([g])])
    # Window 1: mean of 1..4 = 2.5; window 2: mean of 5 and 6 = 5.5.
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-6)
    np.testing.assert_allclose(var.numpy(), [-8.0], rtol=1e-6)
    assert int(opt.skipped_micro_batches.numpy()) == 2
