"""Cases reported by trying the package from outside, as a user would: each
failed before its fix."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import ends_mid_window

import keras_accum as ka

MAKERS = {
    "gradient_accumulation": lambda **kw: ka.GradientAccumulation(keras.optimizers.Adam(), **kw),
    "invariant_adam": lambda **kw: ka.InvariantAdam(**kw),
    "update_accumulation_adam": lambda **kw: ka.UpdateAccumulationAdam(**kw),
}


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("integer", [np.int64, np.int32])
def test_numpy_integers_are_integers(name, integer):
    optimizer = MAKERS[name](steps=integer(4))
    assert optimizer.steps == 4 and type(optimizer.steps) is int
    assert type(optimizer.get_config()["steps"]) is int
    boundaries = np.cumsum([100, 100])[:1]  # what a user computes
    schedule = ka.PiecewiseSteps(list(boundaries), [integer(1), integer(2)])
    assert schedule.get_config()["boundaries"] == [100]
    assert schedule.get_config()["values"] == [1, 2]
    adaptive = ka.AdaptiveSteps(integer(1), integer(8), micro_batch_size=integer(32))
    assert (adaptive.min_steps, adaptive.max_steps, adaptive.micro_batch_size) == (1, 8, 32)


@pytest.mark.parametrize("name", MAKERS)
def test_raise_policy_is_refused_under_xla_where_it_could_not_raise(name):
    # TensorFlow drops `check_numerics` from XLA-compiled code: NaN weights,
    # no error, counters at 0. The step is refused when traced instead.
    x = np.ones((8, 3), "float32")
    x[5] = np.nan
    y = np.zeros((8, 1), "float32")
    for jit, error in ((False, tf.errors.InvalidArgumentError), (True, ValueError)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = MAKERS[name](steps=2, nonfinite="raise")
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
        with pytest.raises(error) as raised:
            model.fit(x, y, batch_size=4, verbose=0)
        if jit:
            message = str(raised.value)
            assert "`nonfinite='raise'`" in message and "jit_compile=True" in message
            assert "\n" not in message
            assert all(np.isfinite(w).all() for w in model.get_weights())


def test_adaptive_steps_observe_in_a_tf_function_equals_eager():
    def make():
        steps = ka.AdaptiveSteps(1, 8, 32, smoothing=0.0, min_observations=1)
        ka.InvariantAdam(1e-3, steps=steps).build([keras.Variable(np.zeros(3, "float32"))])
        return steps

    eager, traced = make(), make()
    observe = tf.function(traced.observe)
    for b in (100.0, float("nan"), 20.0, 200.0, float("inf")):
        expected = int(eager.observe(b))
        assert int(observe(tf.constant(b))) == expected
    assert int(traced.steps) == int(eager.steps) == 8


@pytest.mark.parametrize("name", MAKERS)
def test_counters_read_zero_before_the_optimizer_is_built(name):
    optimizer = MAKERS[name](steps=2)
    assert not optimizer.built
    for counter in ("iterations", "micro_step", "skipped_micro_batches", "skipped_updates"):
        assert int(getattr(optimizer, counter)) == 0, counter
    assert not bool(optimizer.has_updated())
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer.apply([tf.ones(2)], [variable])
    assert int(optimizer.micro_step) == 1 and not bool(optimizer.has_updated())
    optimizer.apply([tf.ones(2)], [variable])
    assert int(optimizer.micro_step) == 2 and bool(optimizer.has_updated())


def test_weighing_after_a_later_compile():
    # weigh_micro_batches, then a re-compile with a token-mean loss: the
    # weighing belongs to one compile (it wraps that compile's loss), so it
    # is called again after the later one, and the weights are then those
    # of the big batch (token counts). 0.2.0 carried it over by replacing
    # the model's methods.
    rng = np.random.RandomState(2)
    x = rng.randint(1, 20, size=(64, 7))
    for i, length in enumerate(rng.randint(1, 8, size=64)):
        x[i, length:] = 0
    y = rng.randint(0, 3, size=(64, 7))
    tokens = (x != 0).astype("float32")

    def loss(reduction):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)

    def model():
        keras.utils.set_random_seed(1)
        layers = [keras.Input((7,), dtype="int32"), keras.layers.Embedding(20, 4)]
        return keras.Sequential(layers + [keras.layers.Dense(3)])

    def sgd():
        return keras.optimizers.SGD(0.5, momentum=0.9)

    big = model()
    big.compile(optimizer=sgd(), loss=loss("mean_with_sample_weight"))
    big.fit(x, y, sample_weight=tokens, batch_size=16, shuffle=False, verbose=0)

    weighed = model()
    weighed.compile(optimizer=ka.GradientAccumulation(sgd(), steps=2), loss=loss("mean"))
    ka.weigh_micro_batches(weighed)
    accumulate = ka.GradientAccumulation(sgd(), steps=2)
    weighed.compile(optimizer=accumulate, loss=loss("mean_with_sample_weight"))
    ka.weigh_micro_batches(weighed)
    weighed.fit(x, y, sample_weight=tokens, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(weighed.get_weights(), big.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_a_users_tf_function_traces_without_autograph_warnings():
    # AutoGraph cannot convert a method whose body is only a docstring and
    # asks the user to report a TensorFlow bug: `_drop_window` (skip_window)
    # and `StepsSchedule.build` (a schedule built while tracing) were such.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    tf.get_logger().addHandler(handler)
    try:
        steps = ka.PiecewiseSteps([4], [1, 2])
        optimizer = ka.UpdateAccumulationAdam(steps=steps, nonfinite="skip_window")
        variable = keras.Variable(np.zeros(2, "float32"))
        apply = tf.function(lambda g: optimizer.apply([g], [variable]))
        apply(tf.ones(2))
    finally:
        tf.get_logger().removeHandler(handler)
    assert int(optimizer.micro_step) == 1
    assert not [r for r in records if "AutoGraph could not transform" in r.getMessage()]


# -- Found by outside users of 0.2.0 ---------------------------------------


def _dense_model(optimizer, outputs=1):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(outputs)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


# Under mixed_float16 the loss scaler skips the first step (its scale starts
# too high), so one micro-batch of the last window is pending at the end.
@ends_mid_window
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_swap_ema_weights_sees_the_wrapped_optimizers_ema(policy):
    # Under mixed_float16 Keras's callback unwraps the loss scaler and lands
    # on the wrapper: it must show the inner optimizer's EMA.
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inner = keras.optimizers.AdamW(0.1, use_ema=True, ema_momentum=0.5)
        model = _dense_model(ka.GradientAccumulation(inner, steps=2))
        x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
        swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[swap])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    if policy == "mixed_float16":
        optimizer = optimizer.inner_optimizer  # the loss scaler's
    assert optimizer.use_ema and len(optimizer._model_variables_moving_average) == 2
    # At the end of fit the callback leaves the moving averages in the model.
    for weight, average in zip(model.trainable_weights, inner._model_variables_moving_average):
        np.testing.assert_array_equal(weight.numpy(), average.numpy())
    # The wrapper builds no EMA of its own.
    assert not any("average" in v.path for v in optimizer._variables)


def test_load_weights_into_a_fresh_wrapper_warns_of_nothing(tmp_path, recwarn):
    make = lambda: _dense_model(ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2))
    model = make()
    x = np.ones((8, 3), "float32")
    model.fit(x, x[:, :1], batch_size=2, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    recwarn.clear()
    restored = make()
    restored.load_weights(tmp_path / "w.weights.h5")
    assert not [str(w.message) for w in recwarn.list if "Skipping" in str(w.message)]
    restored.optimizer.build(restored.trainable_variables)  # restores the state
    for ours, saved in zip(restored.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(ours.numpy(), saved.numpy())


def test_load_weights_of_another_steps_still_warns(tmp_path):
    # A true loss of state (saved with steps=2, loaded with steps=3 into a
    # model that then builds) is still said.
    model = _dense_model(ka.InvariantAdam(0.1, steps=2))
    x = np.ones((8, 3), "float32")
    model.fit(x, x[:, :1], batch_size=2, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    schedule = ka.PiecewiseSteps([4], [3, 3])  # one more pair of window variables
    restored = _dense_model(ka.InvariantAdam(0.1, steps=schedule))
    restored.load_weights(tmp_path / "w.weights.h5")
    with pytest.warns(UserWarning, match="Cannot restore optimizer"):
        restored.optimizer.build(restored.trainable_variables)


@pytest.mark.parametrize("name", MAKERS)
def test_fit_ending_inside_a_window_says_so(name):
    # 60 examples, micro-batch 4, steps=4: 15 micro-batches, 3 never applied.
    model = _dense_model(MAKERS[name](steps=4))
    x = np.ones((60, 3), "float32")
    with pytest.warns(UserWarning, match=r"ended inside a window: 3 of its 4 micro-batches") as w:
        model.fit(x, x[:, :1], batch_size=4, verbose=0)
    assert model.optimizer.pending_micro_batches() == 3
    # It points at the caller's `fit`, not at a line of Keras.
    (warning,) = [x for x in w.list if "inside a window" in str(x.message)]
    assert warning.filename == __file__, warning.filename


@pytest.mark.parametrize("name", MAKERS)
def test_fit_in_a_loop_is_told_of_the_pending_window_once(name, recwarn):
    model = _dense_model(MAKERS[name](steps=4))
    x = np.ones((60, 3), "float32")
    for _ in range(3):  # 15, 30, 45 micro-batches: each fit ends inside a window
        model.fit(x, x[:, :1], batch_size=4, verbose=0)
    assert len([w for w in recwarn.list if "inside a window" in str(w.message)]) == 1


@pytest.mark.parametrize("name", MAKERS)
def test_fit_ending_on_a_boundary_warns_of_nothing(name, recwarn):
    model = _dense_model(MAKERS[name](steps=4))
    x = np.ones((64, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, verbose=0)
    assert not [w for w in recwarn.list if "inside a window" in str(w.message)]
    assert model.optimizer.pending_micro_batches() == 0


def test_pending_micro_batches_follow_a_schedule():
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer = ka.InvariantAdam(0.1, steps=ka.PiecewiseSteps([2], [2, 3]))
    seen = []
    for _ in range(6):
        optimizer.apply([tf.ones(2)], [variable])
        seen.append(optimizer.pending_micro_batches())
    assert seen == [1, 0, 1, 2, 0, 1]


def test_loss_scaler_around_overwrite_only_variables():
    # Only float8-style scales (overwritten with their gradient): the window
    # check got an empty list and raised IndexError.
    scale = keras.Variable(np.ones(()), dtype="float32")
    scale.overwrite_with_gradient = True
    optimizer = keras.optimizers.LossScaleOptimizer(
        ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2)
    )
    optimizer.apply([tf.constant(3.0)], [scale])
    optimizer.apply([tf.constant(5.0)], [scale])
    assert float(scale.numpy()) == 5.0


@pytest.mark.parametrize("wrapped", [False, True], ids=["optimizer", "inner_optimizer"])
def test_optimizer_created_outside_the_scope_is_named(wrapped):
    from conftest import mirrored_strategy

    strategy = mirrored_strategy()
    inner = keras.optimizers.Adam(0.1)  # outside the scope
    with strategy.scope():
        variable = keras.Variable(np.zeros(2, "float32"))
        if wrapped:
            optimizer = ka.GradientAccumulation(inner, steps=2)
    if not wrapped:
        optimizer = ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2)
    name = inner.name if wrapped else optimizer.name
    with pytest.raises(ValueError, match=rf"Optimizer '{name}' .*strategy.scope\(\)"):
        strategy.run(lambda: optimizer.apply([tf.ones(2)], [variable]))


@pytest.mark.parametrize("form", ["eager", "graph"])
@pytest.mark.parametrize("name", MAKERS)
def test_raise_policy_names_the_optimizer_and_the_micro_step_in_one_line(name, form):
    from keras_accum import nonfinite

    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = MAKERS[name](steps=2, nonfinite="raise")
    step = lambda g: optimizer.apply([g], [variable])
    step = step if form == "eager" else tf.function(step)
    step(tf.ones(2))
    with pytest.raises(nonfinite.NonFiniteGradientError) as caught:
        with nonfinite.explained():
            step(tf.constant([1.0, np.nan]))
    assert str(caught.value) == (
        f"{optimizer.name}: non-finite gradient (nonfinite=raise) at micro-step 2"
    )
    np.testing.assert_array_equal(variable.numpy(), np.ones(2))


def test_custom_loop_raises_the_one_line_error():
    from keras_accum import nonfinite, training

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    x = np.ones((8, 3), "float32")
    x[5, 0] = np.nan
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)
    optimizer = ka.InvariantAdam(0.1, steps=2, nonfinite="raise")
    with pytest.raises(nonfinite.NonFiniteGradientError, match=r"micro-step 3$"):
        training.train(model, optimizer, "mse", dataset, epochs=1, verbose=0)
