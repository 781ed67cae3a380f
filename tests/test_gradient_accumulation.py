"""GradientAccumulation: algebra, big-batch equivalence, per-update state."""

import hypothesis
import hypothesis.strategies as st
import keras
import numpy as np
import pytest
import references
import tensorflow as tf

import keras_accum as ka
from keras_accum.drivers.tensorflow import _execution


def drive(optimizer, variables, micro_grads, weights=None):
    """Feeds micro-batch gradients one `apply` call at a time; returns the
    variables' values after each call."""
    history = []
    for j, grads in enumerate(micro_grads):
        weight = None if weights is None else weights[j]
        optimizer.apply([tf.constant(g) for g in grads], variables, weight=weight)
        history.append([v.numpy().copy() for v in variables])
    return history


def test_mean_of_1_2_3_4_is_2_5():
    var = keras.Variable(np.zeros(3, "float32"))
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=4)
    history = drive(opt, [var], [[np.full(3, g, "float32")] for g in [1, 2, 3, 4]])
    np.testing.assert_array_equal(history[-1][0], np.full(3, -2.5))
    assert int(opt.iterations) == 1 and int(opt.micro_step) == 4
    assert bool(opt.has_updated())


def test_params_bit_identical_on_non_boundary_steps():
    rng = np.random.default_rng(0)
    init = rng.normal(size=(4, 3)).astype("float32")
    var = keras.Variable(init)
    opt = ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=3)
    before = init
    for j in range(9):
        opt.apply([tf.constant(rng.normal(size=(4, 3)), "float32")], [var])
        boundary = (j + 1) % 3 == 0
        assert bool(opt.has_updated()) == boundary
        if boundary:
            assert not np.array_equal(var.numpy(), before)
        else:
            np.testing.assert_array_equal(var.numpy(), before)
        before = var.numpy().copy()


def mse_grads(theta, x, y):
    """Gradient of mean_i 0.5 * (x_i . theta - y_i)^2 over a micro-batch."""
    return x.T @ (x @ theta - y) / len(x)


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.05),
        lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    ],
    ids=["sgd", "adam", "adamw"],
)
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_big_batch_equivalence_with_unequal_micro_batches(make_inner, sizes, seed):
    # Micro-batch means weighted by item counts reproduce the big batch,
    # including a short last micro-batch, over two windows.
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    theta0 = rng.normal(size=(3, 1)).astype("float32")
    batches = [
        (rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32"))
        for _ in range(2)
    ]
    big = keras.Variable(theta0)
    big_opt = make_inner()
    acc = keras.Variable(theta0)
    acc_opt = ka.GradientAccumulation(make_inner(), steps=len(sizes))
    for x, y in batches:
        big_opt.apply([tf.constant(mse_grads(big.numpy(), x, y))], [big])
        edges = np.cumsum([0] + sizes)
        for a, b in zip(edges[:-1], edges[1:]):
            g = mse_grads(acc.numpy(), x[a:b], y[a:b])
            acc_opt.apply([tf.constant(g)], [acc], weight=float(b - a))
    np.testing.assert_allclose(acc.numpy(), big.numpy(), rtol=1e-5, atol=1e-6)
    assert int(acc_opt.iterations) == int(big_opt.iterations) == 2


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_adam_inner_matches_numpy_reference(steps):
    rng = np.random.default_rng(steps)
    targets = rng.normal(size=(4 * steps, 5))
    theta = [rng.normal(size=5)]
    var = keras.Variable(theta[0].astype("float32"))
    opt = ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=steps)
    reference = references.GradientAccumulation(references.Adam(0.1), steps)
    for target in targets:
        # Loss 0.5 |theta - target|^2: gradient at the current variables.
        opt.apply([var - target.astype("float32")], [var])
        theta = reference.apply(theta, [theta[0] - target])
        # Adam's m / sqrt(v) amplifies float32 rounding where g is small.
        np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-5)


def run_inner_on_window_means(make_inner, steps, micro_grads, var_init):
    """Reference: the same inner optimizer stepped on each window's mean."""
    var = keras.Variable(var_init)
    inner = make_inner()
    for w in range(0, len(micro_grads), steps):
        mean = np.mean(micro_grads[w : w + steps], axis=0)
        inner.apply([tf.constant(mean)], [var])
    return var, inner


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.Adam(0.1, global_clipnorm=0.5),
        lambda: keras.optimizers.Adam(0.1, clipnorm=0.5),
        lambda: keras.optimizers.SGD(0.1, clipvalue=0.3),
        lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)),
        lambda: keras.optimizers.AdamW(0.1, weight_decay=0.5, use_ema=True, ema_momentum=0.5),
        lambda: keras.optimizers.Lion(0.05),
    ],
    ids=["global_clipnorm", "clipnorm", "clipvalue", "schedule", "adamw_ema", "lion"],
)
def test_inner_state_advances_once_per_update(make_inner):
    # Clipping, schedules, weight decay and EMA all see the window mean and
    # the update count: identical to the inner optimizer fed window means.
    steps = 3
    rng = np.random.default_rng(1)
    init = rng.normal(size=(2, 4)).astype("float32")
    micro = rng.normal(size=(4 * steps, 2, 4)).astype("float32") * 2
    ref_var, ref_opt = run_inner_on_window_means(make_inner, steps, micro, init)
    var = keras.Variable(init)
    opt = ka.GradientAccumulation(make_inner(), steps=steps)
    drive(opt, [var], [[g] for g in micro])
    np.testing.assert_allclose(var.numpy(), ref_var.numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.iterations) == int(ref_opt.iterations) == 4
    for mine, ref in zip(opt.inner_optimizer.variables, ref_opt.variables):
        np.testing.assert_allclose(
            mine.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6, err_msg=mine.path
        )
    np.testing.assert_allclose(float(opt.learning_rate), float(ref_opt.learning_rate))


def test_float16_variables_accumulate_in_float32():
    # 1 followed by 255 terms of 2**-12: a float16 running sum stays at 1
    # (2**-12 is below half an ulp of 1), a float32 one is exact.
    steps = 256
    grads = np.full((steps, 4), 2.0**-12, "float16")
    grads[0] = 1.0
    var = keras.Variable(np.zeros(4, "float16"), dtype="float16")
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=steps)
    opt.build([var])
    assert {a.dtype for a in opt._accumulators} == {"float32"}
    drive(opt, [var], [[g] for g in grads])
    expected = np.float16(-(1 + 255 * 2.0**-12) / steps)
    np.testing.assert_array_equal(var.numpy(), np.full(4, expected))
    naive = np.float16(0)
    for g in grads[:, 0]:
        naive = np.float16(naive + g)
    assert naive == 1.0 and np.float16(-naive / steps) != expected


def test_sparse_gradients_match_dense():
    rows = tf.constant([0, 2, 2, 5])
    values = tf.constant(np.arange(12, dtype="float32").reshape(4, 3))
    sparse = tf.IndexedSlices(values, rows, tf.constant([6, 3]))
    dense = tf.convert_to_tensor(sparse)
    results = []
    for g in (sparse, dense):
        var = keras.Variable(np.ones((6, 3), "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2)
        opt.apply([g], [var])
        double = (
            tf.IndexedSlices(g.values * 2, g.indices, g.dense_shape)
            if isinstance(g, tf.IndexedSlices)
            else g * 2
        )
        opt.apply([double], [var])
        results.append(var.numpy())
    np.testing.assert_array_equal(results[0], results[1])


def test_embedding_model_trains_with_fit():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(10, 3),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.random.default_rng(0).integers(0, 10, (16, 4)).astype("int32")
    y = (x[:, 0] > 4).astype("int32")
    before = model.get_weights()[0].copy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 2
    assert not np.array_equal(model.get_weights()[0], before)


def test_inside_loss_scale_optimizer():
    # LossScaleOptimizer unscales, then hands each micro-batch to us: the
    # result equals unscaled accumulation, and a non-finite micro-batch is
    # dropped by the loss scaler before it reaches the window.
    rng = np.random.default_rng(3)
    micro = rng.normal(size=(4, 5)).astype("float32")
    plain = keras.Variable(np.zeros(5, "float32"))
    drive(
        ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2), [plain], [[g] for g in micro]
    )
    scaled = keras.Variable(np.zeros(5, "float32"))
    lso = keras.optimizers.LossScaleOptimizer(
        ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2),
        initial_scale=128.0,
    )
    lso.build([scaled])
    for g in micro:
        lso.apply([tf.constant(g) * lso.dynamic_scale], [scaled])
    np.testing.assert_allclose(scaled.numpy(), plain.numpy(), rtol=1e-6)
    # The inner optimizer's count: a LossScaleOptimizer's own `iterations`
    # is that one from Keras 3.9 on, and stays 0 before (also around Adam).
    assert int(lso.inner_optimizer.iterations) == 2
    lso.apply([tf.constant(np.full(5, np.inf, "float32"))], [scaled])
    assert np.all(np.isfinite(scaled.numpy()))
    assert float(lso.dynamic_scale) == 64.0


def test_mixed_float16_fit_trains():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2),
            loss="mse",
        )
        x = np.ones((8, 3), "float32")
        history = model.fit(x, np.zeros((8, 2), "float32"), batch_size=2, epochs=2, verbose=0)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert int(model.optimizer.inner_optimizer.iterations) == 4
        assert history.history["loss"][1] < history.history["loss"][0]
    finally:
        keras.mixed_precision.set_global_policy("float32")


class TestNonFinite:
    micro = [np.full(2, g, "float32") for g in (1.0, np.nan, 3.0, 5.0)]

    def run(self, nonfinite, steps=2):
        var = keras.Variable(np.zeros(2, "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=steps, nonfinite=nonfinite)
        history = drive(opt, [var], [[g] for g in self.micro])
        return opt, history

    def test_skip_micro_batch_reweights_the_window(self):
        opt, history = self.run("skip_micro_batch")
        # Window 1 = {1, NaN}: mean of the finite part only. Window 2 = 4.
        np.testing.assert_array_equal(history[1][0], [-1.0, -1.0])
        np.testing.assert_array_equal(history[3][0], [-5.0, -5.0])
        assert int(opt.skipped_micro_batches.numpy()) == 1
        assert int(opt.skipped_updates) == 0

    def test_window_of_only_non_finite_is_dropped(self):
        var = keras.Variable(np.zeros(2, "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.Adam(1.0), steps=2)
        drive(opt, [var], [[np.full(2, np.nan, "float32")]] * 2)
        np.testing.assert_array_equal(var.numpy(), [0.0, 0.0])
        assert int(opt.skipped_updates) == 1 and int(opt.iterations) == 0
        assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables)

    def test_skip_window(self):
        opt, history = self.run("skip_window")
        np.testing.assert_array_equal(history[1][0], [0.0, 0.0])
        np.testing.assert_array_equal(history[3][0], [-4.0, -4.0])
        assert int(opt.skipped_updates) == 1
        # Checked once per window, on the sums: micro-batches are not counted.
        assert int(opt.skipped_micro_batches.numpy()) == 0
        assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables)

    def test_default_drops_the_window(self):
        var = keras.Variable(np.zeros(2, "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=2)
        assert opt.nonfinite == "skip_window"
        history = drive(opt, [var], [[g] for g in self.micro])
        np.testing.assert_array_equal(history[1][0], [0.0, 0.0])
        np.testing.assert_array_equal(history[3][0], [-4.0, -4.0])

    def test_skip_window_leaves_finite_sums_that_overflow_alone(self):
        # Finite gradients whose float32 sum over the accumulator is inf: the
        # window is applied (the check falls back to an elementwise test).
        var = keras.Variable(np.zeros(4, "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.SGD(1e-30), steps=2)
        big = np.full(4, 1.0e38, "float32")  # S = 2e38 per element, 8e38 in all
        drive(opt, [var], [[big], [big]])
        assert int(opt.iterations) == 1 and int(opt.skipped_updates) == 0
        np.testing.assert_allclose(var.numpy(), -1.0e8, rtol=1e-6)

    def test_skip_window_under_xla_equals_graph_on_a_bad_middle_micro_batch(self):
        results = []
        for jit_compile in (False, True):
            var = keras.Variable(np.zeros(2, "float32"))
            opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=3)
            opt.build([var])
            step = tf.function(lambda g: opt.apply([g], [var]), jit_compile=jit_compile)
            for g in (1.0, np.inf, 3.0, 2.0, 4.0, 6.0):
                step(tf.fill([2], np.float32(g)))
            results.append((var.numpy(), int(opt.skipped_updates)))
            assert all(np.all(np.isfinite(v.numpy())) for v in opt.variables), jit_compile
        for var_value, skipped in results:
            # Window {1, inf, 3} dropped; window {2, 4, 6}: mean 4.
            np.testing.assert_array_equal(var_value, [-4.0, -4.0])
            assert skipped == 1

    def test_raise(self):
        with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
            self.run("raise")


@pytest.mark.parametrize("form", ["eager", "graph", "xla"])
@pytest.mark.parametrize("size", [4, _execution.SMALL])  # XLA: elementwise, by sums
def test_all_finite_is_exact_also_when_a_sum_overflows(form, size):
    check = _execution.all_finite
    if form != "eager":
        check = tf.function(_execution.all_finite, jit_compile=form == "xla", autograph=False)
    big = tf.fill([size], 3.0e38)  # finite elements whose float32 sum is inf
    assert bool(check([big, tf.ones([2])]))
    for bad in (np.nan, np.inf, -np.inf):
        assert not bool(
            check(
                [tf.ones([size]), tf.tensor_scatter_nd_update(tf.ones([size]), [[size - 1]], [bad])]
            )
        )
    both = tf.concat([[np.inf, -np.inf], tf.ones([size - 2])], 0)
    assert not bool(check([both]))  # its sum is NaN
