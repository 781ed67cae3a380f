"""`AdaptiveSteps` and `keras_accum.diagnostics` on whichever backend Keras
runs: the schedule's rule and the noise-scale formulas against numpy,
`AdaptiveSteps` driving `model.fit`, and `NoiseScaleCallback`'s probe.

Backend-free (keras.ops and numpy), like the rest of tests/backends.
"""

import math

import keras
import numpy as np
import pytest
import references
from conftest import ends_mid_window

import keras_accum as ka
from keras_accum import _backend, diagnostics

NAN, INF = float("nan"), float("inf")
# float64 state, except under JAX without x64 (float32 there).
WIDE = _backend.wide_float() == "float64"


def number(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).item()


# -- AdaptiveSteps ------------------------------------------------------------------


def built(schedule):
    opt = ka.InvariantAdam(0.01, steps=schedule, scaling_rule="power")
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    return opt


# Away from the rounding edges of ceil(B_n / 32) in float32.
ESTIMATES = [NAN, 900.0, 40.0, INF, NAN, 10.0, -5.0, -INF, 70.0, 20.0, 1e9, 64.5, 100.0]


@pytest.mark.parametrize(
    "smoothing, settle, pow2", [(0.9, 4, False), (0.0, 1, False), (0.5, 2, True)]
)
def test_adaptive_steps_follow_the_numpy_rule(smoothing, settle, pow2):
    top = 16 if pow2 else 8
    schedule = ka.AdaptiveSteps(
        2, top, 32, smoothing=smoothing, min_observations=settle, powers_of_two=pow2
    )
    built(schedule)
    expected = references.adaptive_steps(ESTIMATES, 2, top, 32, smoothing, settle, 2, pow2)
    rtol = 1e-12 if WIDE else 1e-6
    for b, (smoothed, n, steps) in zip(ESTIMATES, expected):
        assert number(schedule.propose(b)) == steps
        assert number(schedule.observe(b)) == steps
        decision = schedule.decisions[-1]
        np.testing.assert_allclose(decision.smoothed, smoothed, rtol=rtol)
        assert (decision.observations, decision.steps) == (n, steps)
        assert decision.reason == ("decided" if n >= settle else "settling")
    smoothed, n, steps = expected[-1]
    assert (number(schedule.steps), number(schedule.observations)) == (steps, n)
    np.testing.assert_allclose(number(schedule.smoothed), smoothed, rtol=rtol)


def test_adaptive_steps_warmup_and_config_round_trip():
    warmup = ka.PiecewiseSteps([4], [1, 2])
    schedule = ka.AdaptiveSteps(1, 8, 16, smoothing=0.0, min_observations=1, warmup=warmup)
    built(schedule)
    assert [number(schedule(s)) for s in (0, 3, 4, 9)] == [1, 1, 2, 2]
    schedule.observe(100.0)  # ceil(100 / 16) = 7
    assert [number(schedule(s)) for s in (3, 4)] == [1, 7]
    assert schedule.decisions[-1].reason == "warmup"
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert again.get_config() == schedule.get_config()


def data(count=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(count, 1))).astype("float32")
    return x, y


def model(seed=0, layers=()):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), *layers]
        + [keras.layers.Dense(1)]
    )


class Observer(keras.callbacks.Callback):
    """Feeds `estimates[batch]` (where given) to the optimizer's schedule
    after that batch and records each batch's window size."""

    def __init__(self, estimates):
        super().__init__()
        self.estimates, self.sizes = estimates, []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer  # under JAX: syncs the state first
        self.sizes.append(number(optimizer.window_steps))
        if batch in self.estimates:
            optimizer.steps.observe(self.estimates[batch])


@ends_mid_window  # 2 micro-batches pending, asserted
def test_adaptive_steps_drive_fit():
    """Micro-batches of 4; B_simple 30 after batch 1 gives windows of
    ceil(30 / 4) = 8 capped at 4 from micro-step 2 on; a later, smaller
    estimate does not shrink them. The run equals PiecewiseSteps([2], [1, 4])."""
    x, y = data()
    steps = ka.AdaptiveSteps(1, 4, 4, smoothing=0.0, min_observations=1)
    adaptive = model()
    adaptive.compile(optimizer=ka.InvariantAdam(0.01, steps=steps), loss="mse")
    observer = Observer({1: 30.0, 4: 1.0})
    adaptive.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[observer])
    assert observer.sizes == [1, 1, 4, 4, 4, 4, 4, 4]
    optimizer = adaptive.optimizer
    assert number(optimizer.iterations) == 3  # 1 + 1 + one window of 4, 2 pending
    assert number(optimizer.micro_step) == 8
    assert optimizer.pending_micro_batches() == 2
    assert [d.steps for d in steps.decisions] == [4, 4]
    assert [d.micro_step for d in steps.decisions] == [2, 5]

    piecewise = model()
    piecewise.compile(
        optimizer=ka.InvariantAdam(0.01, steps=ka.PiecewiseSteps([2], [1, 4])), loss="mse"
    )
    piecewise.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert piecewise.optimizer.pending_micro_batches() == 2
    for a, b in zip(adaptive.get_weights(), piecewise.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- diagnostics --------------------------------------------------------------------


def np_estimates(small, big, b, B):
    return (B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)


def test_squared_norm_and_estimates_match_numpy():
    rng = np.random.default_rng(3)
    grads = [rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=4).astype("float32")]
    weights = [rng.uniform(size=(3, 2)).astype("float32"), rng.uniform(size=4).astype("float32")]
    tensors = [keras.ops.convert_to_tensor(g) for g in grads]
    np.testing.assert_allclose(
        number(diagnostics.squared_norm(tensors + [None])),
        sum(np.sum(g.astype("float64") ** 2) for g in grads),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        number(diagnostics.squared_norm(tensors, weights)),
        sum(np.sum(w * g.astype("float64") ** 2) for g, w in zip(grads, weights)),
        rtol=1e-6,
    )
    g2, trace = diagnostics.noise_scale_estimates(3.0, 1.5, 4, 16)
    np.testing.assert_allclose((number(g2), number(trace)), np_estimates(3.0, 1.5, 4, 16))
    with pytest.raises(ValueError, match="big_batch"):
        diagnostics.noise_scale_estimates(1.0, 1.0, 4, 4)


def test_noise_scale_tracker_matches_numpy():
    """Known micro-batch gradients, three windows: the bias-corrected EMAs
    of |G|^2 and tr(Sigma) and their ratio, as the module docstring says."""
    rng = np.random.default_rng(4)
    b, ema = 8, 0.7
    tracker = diagnostics.GradientNoiseScale(ema)
    assert math.isnan(number(tracker.b_simple))
    acc_g2 = acc_trace = 0.0
    for t, kappa in enumerate([2, 4, 3], start=1):
        window = [[rng.normal(1.0, 2.0, size=(4, 3)), rng.normal(size=3)] for _ in range(kappa)]
        window = [[g.astype("float32") for g in grads] for grads in window]
        tensors = [[keras.ops.convert_to_tensor(g) for g in grads] for grads in window]
        tracker.update_from_micro_grads(tensors, b)
        small = np.mean([sum(np.sum(g.astype("float64") ** 2) for g in gs) for gs in window])
        big = sum(np.sum(np.mean(col, 0, dtype="float64") ** 2) for col in zip(*window))
        g2, trace = np_estimates(small, big, b, kappa * b)
        acc_g2 = ema * acc_g2 + (1 - ema) * g2
        acc_trace = ema * acc_trace + (1 - ema) * trace
        correction = 1 - ema**t
        np.testing.assert_allclose(number(tracker.g2), acc_g2 / correction, rtol=1e-4)
        np.testing.assert_allclose(number(tracker.trace_sigma), acc_trace / correction, rtol=1e-4)
        np.testing.assert_allclose(number(tracker.b_simple), acc_trace / acc_g2, rtol=1e-4)
    assert number(tracker.updates) == 3
    result = tracker.result()
    assert sorted(result) == ["grad_sq_norm", "noise_scale", "trace_sigma"]


def test_nonpositive_g2_reports_inf():
    tracker = diagnostics.GradientNoiseScale(0.0)
    tracker.update(1.0, 0.5, 4, 16)  # |G|^2 = (16 * 0.5 - 4) / 12 > 0
    assert np.isfinite(number(tracker.b_simple))
    tracker.update(1.0, 0.1, 4, 16)  # |G|^2 < 0
    assert number(tracker.b_simple) == INF


def test_adam_preconditioned_norm_matches_numpy():
    rng = np.random.default_rng(5)
    params = [keras.Variable(rng.normal(size=(3, 2)).astype("float32"))]
    optimizer = keras.optimizers.Adam(0.01, epsilon=1e-3)
    norm = diagnostics.adam_preconditioned_noise_norm
    optimizer.build(params)
    grads = [keras.ops.convert_to_tensor(rng.normal(size=(3, 2)).astype("float32"))]
    g = keras.ops.convert_to_numpy(grads[0]).astype("float64")
    # Before any update: uniform weights 1 / epsilon.
    np.testing.assert_allclose(number(norm(optimizer)(grads)), np.sum(g**2) / 1e-3, rtol=1e-5)
    for _ in range(3):
        optimizer.apply([keras.ops.convert_to_tensor(rng.normal(size=(3, 2)), "float32")], params)
    v = keras.ops.convert_to_numpy(optimizer._velocities[0]).astype("float64")
    weights = 1 / (np.sqrt(v / (1 - 0.999**3)) + 1e-3)
    np.testing.assert_allclose(number(norm(optimizer)(grads)), np.sum(weights * g**2), rtol=1e-5)


def linear_model():
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    net.compile(optimizer="sgd", loss="mse")
    return net


def test_callback_probe_matches_numpy_and_moves_nothing():
    """Dense(1) + MSE: micro-batch j's gradient is 2/b [X_j^T r_j, sum r_j],
    r = prediction - y; the probe draws its rows with the callback's seed."""
    b, kappa, seed = 4, 3, 7
    rng = np.random.default_rng(2)
    x = rng.normal(size=(20, 3)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    net = linear_model()
    callback = diagnostics.NoiseScaleCallback((x, y), b, kappa, ema=0.0, seed=seed)
    callback.set_model(net)
    before = [keras.ops.convert_to_numpy(v) for v in net.variables]
    callback.probe_fn(callback._next_probe())
    for v, old in zip(net.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), old)

    rows = np.random.default_rng(seed).choice(20, b * kappa, replace=False)
    W, c = (keras.ops.convert_to_numpy(v).astype("float64") for v in net.trainable_variables)
    grads = []
    for j in range(kappa):
        xj, yj = x[rows[j * b : (j + 1) * b]], y[rows[j * b : (j + 1) * b]]
        r = xj @ W + c - yj
        grads.append(np.concatenate([2 / b * xj.T @ r, [2 / b * r.sum(0)]]))
    small = np.mean([np.sum(g**2) for g in grads])
    big = np.sum(np.mean(grads, 0) ** 2)
    g2, trace = np_estimates(small, big, b, b * kappa)
    np.testing.assert_allclose(number(callback.tracker.g2), g2, rtol=1e-4)
    np.testing.assert_allclose(number(callback.tracker.trace_sigma), trace, rtol=1e-4)


def test_callback_in_fit_logs_finite_values_and_restores_state():
    x, y = data(64)
    net, plain = (
        model(layers=[keras.layers.BatchNormalization(), keras.layers.Dropout(0.2)])
        for _ in range(2)
    )
    for mine, theirs in zip(plain.variables, net.variables):  # the dropout seeds too
        mine.assign(keras.ops.convert_to_numpy(theirs))  # a copy: JAX donates buffers
    net.compile(optimizer=ka.InvariantAdam(0.01, steps=2), loss="mse")
    callback = diagnostics.NoiseScaleCallback((x, y), 8, 4, every_n_batches=2, seed=0)
    keras.utils.set_random_seed(1)  # PyTorch's dropout draws from the global generator
    history = net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    for key in ("noise_scale", "trace_sigma", "grad_sq_norm"):
        assert key in history.history
        assert all(np.isfinite(history.history[key])), history.history
    assert number(callback.tracker.updates) == 8  # 2 epochs of 8 batches, every 2nd
    state = callback.get_state()
    fresh = diagnostics.NoiseScaleCallback((x, y), 8, 4, every_n_batches=2, seed=0)
    fresh.set_state(state)
    assert fresh.get_state() == state

    # The probes moved no weight and no batch-norm statistic: the same
    # training without them ends at the same weights.
    plain.compile(optimizer=ka.InvariantAdam(0.01, steps=2), loss="mse")
    keras.utils.set_random_seed(1)
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(net.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
