"""The three optimizers on whichever backend Keras runs: numpy references,
`fit` against the big batch, Keras's Adam at `steps=1`, saving mid-window,
the non-finite policies and the refusals.

Backend-free (keras.ops and numpy): `pytest tests/backends` runs them under
TensorFlow with the rest of the suite; `.ci/backends` runs them again under
`KERAS_BACKEND=jax` and `KERAS_BACKEND=torch`, each in its own process.
"""

import os
import sys

import keras
import numpy as np
import pytest
import references as ref
from conftest import ends_mid_window

import keras_accum as ka

BACKEND = keras.backend.backend()
# Keras's PyTorch Adam runs fused `torch._foreach_*` kernels, which round
# otherwise than the `keras.ops` form that Keras's TensorFlow and JAX Adam
# (and these optimizers, everywhere) compute: equal to rounding there.
ADAM_EXACT = BACKEND != "torch"


def variables(seed=0, shapes=((3, 2), (2,))):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=s).astype("float32")) for s in shapes]


def gradient_stream(count, seed=1, shapes=((3, 2), (2,)), bad=()):
    rng = np.random.default_rng(seed)
    for i in range(count):
        grads = [rng.normal(size=s).astype("float32") for s in shapes]
        if i in bad:
            grads[0][0, 0] = np.nan
        yield grads


def run(optimizer, reference, count, bad=(), weights=None):
    params = variables()
    expected = [p.numpy().astype("float64") for p in params]
    for i, grads in enumerate(gradient_stream(count, bad=bad)):
        weight = None if weights is None else weights[i]
        if weight is None:
            optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], params)
            expected = reference.apply(expected, [g.astype("float64") for g in grads])
        else:
            optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], params, weight=weight)
            expected = reference.apply(expected, [g.astype("float64") for g in grads], weight)
    return [keras.ops.convert_to_numpy(p) for p in params], expected


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


# -- numpy references -------------------------------------------------------------

CASES = {
    "ga_sgd_3": lambda: (
        ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=3),
        ref.GradientAccumulation(ref.SGD(0.1), 3),
    ),
    "ga_adam_2": lambda: (
        ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2),
        ref.GradientAccumulation(ref.Adam(0.01), 2),
    ),
    "ga_adamw_clip": lambda: (
        ka.GradientAccumulation(
            keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5), steps=3
        ),
        ref.GradientAccumulation(ref.Adam(0.01, weight_decay=0.1, global_clipnorm=0.5), 3),
    ),
    "ua_1": lambda: (ka.UpdateAccumulationAdam(0.01, steps=1), ref.UpdateAccumulationAdam(0.01, 1)),
    "ua_3": lambda: (ka.UpdateAccumulationAdam(0.01, steps=3), ref.UpdateAccumulationAdam(0.01, 3)),
    "ua_3_decay_clip": lambda: (
        ka.UpdateAccumulationAdam(0.01, steps=3, weight_decay=0.1, clipnorm=0.5),
        ref.UpdateAccumulationAdam(0.01, 3, weight_decay=0.1, clipnorm=0.5),
    ),
    "ia_1": lambda: (ka.InvariantAdam(0.01, steps=1), ref.InvariantAdam(0.01, 1)),
    "ia_4": lambda: (ka.InvariantAdam(0.01, steps=4), ref.InvariantAdam(0.01, 4)),
    "ia_4_decay_clip": lambda: (
        ka.InvariantAdam(0.01, steps=4, weight_decay=0.1, clipvalue=0.3),
        ref.InvariantAdam(0.01, 4, weight_decay=0.1, clipvalue=0.3),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy_reference(name):
    optimizer, reference = CASES[name]()
    actual, expected = run(optimizer, reference, 12)
    assert_close(actual, expected)
    steps = optimizer.steps
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 12 // steps
    assert int(keras.ops.convert_to_numpy(optimizer.micro_step)) == 12


@pytest.mark.parametrize("name", ["ga_sgd_3", "ua_3", "ia_4"])
def test_skip_micro_batch(name):
    optimizer, reference = CASES[name]()
    optimizer.nonfinite = "skip_micro_batch"  # GradientAccumulation's default: skip_window
    actual, expected = run(optimizer, reference, 12, bad=(1, 5))
    assert all(np.all(np.isfinite(a)) for a in actual)
    assert_close(actual, expected)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_micro_batches)) == 2


def test_weighted_windows():
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=3)
    reference = ref.GradientAccumulation(ref.SGD(0.1), 3)
    weights = [3.0, 1.0, 7.0, 2.0, 2.0, 5.0]
    actual, expected = run(optimizer, reference, 6, weights=weights)
    assert_close(actual, expected)


@pytest.mark.parametrize("optimizer", ["ga", "ua"])
def test_skip_window_drops_the_window(optimizer):
    if optimizer == "ga":
        opt = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=3, nonfinite="skip_window")
    else:
        opt = ka.UpdateAccumulationAdam(0.01, steps=3, nonfinite="skip_window")
    params = variables()
    before = [keras.ops.convert_to_numpy(p) for p in params]
    for grads in gradient_stream(3, bad=(1,)):
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], params)
    for b, p in zip(before, params):
        np.testing.assert_array_equal(b, keras.ops.convert_to_numpy(p))
    assert int(keras.ops.convert_to_numpy(opt.skipped_updates)) == 1
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 0
    for grads in gradient_stream(3, seed=4):  # the next window applies
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], params)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 1
    assert all(np.all(np.isfinite(keras.ops.convert_to_numpy(p))) for p in params)


# One schedule, three spellings: 1 -> 3 at micro-step 2; 5 examples of 4
# and 65 tokens of 64 round up to it.
SPELLINGS = {
    "micro_steps": lambda: ka.PiecewiseSteps([2], [1, 3]),
    "examples": lambda: ka.PiecewiseSteps([5], [1, 3], unit="examples", micro_batch_size=4),
    "tokens": lambda: ka.PiecewiseSteps([65], [1, 3], unit="tokens", tokens_per_micro_batch=64),
}


@pytest.mark.parametrize(
    "unit, per_micro_step",
    [("micro_steps", 1), ("examples", 32), ("examples", 7), ("tokens", 4 * 128)],
)
def test_piecewise_value_at_each_micro_step_in_each_unit(unit, per_micro_step):
    """The window starting at micro-step s gets values[#{b <= s x per}]: a
    boundary switches at the first micro-step whose count reaches it,
    ceil(b / per), also for boundaries off the micro-batch grid."""
    size = {"examples": "micro_batch_size", "tokens": "tokens_per_micro_batch"}.get(unit)
    extra = {size: per_micro_step} if size else {}
    values = [1, 2, 4, 8]
    boundaries = [3 * per_micro_step, 5 * per_micro_step - per_micro_step // 2, 9 * per_micro_step]
    boundaries = sorted(set(boundaries))
    schedule = ka.PiecewiseSteps(boundaries, values[: len(boundaries) + 1], unit=unit, **extra)
    expected_steps = [-(-b // per_micro_step) for b in boundaries]
    assert schedule.micro_step_boundaries == expected_steps
    for s in range(14):
        index = sum(b <= s * per_micro_step for b in boundaries)
        got = int(keras.ops.convert_to_numpy(schedule(keras.ops.convert_to_tensor(s, "int64"))))
        assert got == values[index], (s, got)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("rule", ["invariant", "power", "fixed_beta_1"])
def test_schedule_with_scaling_rule(rule, spelling):
    """PiecewiseSteps 1 -> 3: window k of kappa_k micro-batches with lr and
    betas rescaled (`references.scheduled_invariant_adam`), EMA included;
    the same reference whether the switch is given in micro-steps, examples
    or tokens."""
    steps = SPELLINGS[spelling]()
    opt = ka.InvariantAdam(
        0.01, steps=steps, scaling_rule=rule, use_ema=True, ema_momentum=0.9, weight_decay=0.1
    )
    (theta,) = variables(shapes=((4,),))
    start = keras.ops.convert_to_numpy(theta).astype("float64")
    grads = list(gradient_stream(8, shapes=((4,),)))
    for (g,) in grads:
        opt.apply([keras.ops.convert_to_tensor(g)], [theta])
    windows = [np.stack([grads[0][0]]), np.stack([grads[1][0]])]
    windows += [np.stack([g for (g,) in grads[2:5]]), np.stack([g for (g,) in grads[5:8]])]
    expected, average = ref.scheduled_invariant_adam(
        start, windows, 0.01, 0.9, 0.999, rule=rule, weight_decay=0.1, ema=0.9
    )
    np.testing.assert_allclose(keras.ops.convert_to_numpy(theta), expected, rtol=1e-5, atol=1e-6)
    (ema,) = [a for a in opt._model_variables_moving_average if a is not None]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(ema), average, rtol=1e-5, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 4


def test_partial_window_pending():
    opt = ka.UpdateAccumulationAdam(0.01, steps=4)
    params = variables()
    for grads in gradient_stream(6):
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], params)
    assert opt.pending_micro_batches() == 2
    assert bool(keras.ops.convert_to_numpy(opt.has_updated())) is False


@pytest.mark.parametrize("write", ["assign", "set_weights"])
def test_a_micro_step_written_from_outside_is_read_again(write):
    # PyTorch holds the count in Python between its own writes
    # (`drivers.portable.host_micro_step`); a restore must be seen. Back at
    # micro-step 0 after 2 of a window of 3, the next micro-batch starts a
    # window: no update (a stale count of 2 would end one).
    opt = ka.UpdateAccumulationAdam(0.01, steps=3)
    params = variables()
    stream = [[keras.ops.convert_to_tensor(g) for g in grads] for grads in gradient_stream(3)]
    opt.build(params)
    fresh = [keras.ops.convert_to_numpy(v) for v in opt.variables]
    for grads in stream[:2]:
        opt.apply(grads, params)
    assert opt.pending_micro_batches() == 2
    if write == "assign":
        for variable, value in zip(opt.variables, fresh):
            variable.assign(value)
    else:
        opt.set_weights(fresh)
    opt.apply(stream[2], params)
    assert opt.pending_micro_batches() == 1
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 0


# -- model.fit --------------------------------------------------------------------


def data(count=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def fitted(optimizer, batch_size, epochs=2):
    x, y = data()
    net = model()
    net.compile(optimizer=optimizer, loss="mse")
    net.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return net


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile is PyTorch's")
@pytest.mark.parametrize("make", [ka.UpdateAccumulationAdam, ka.InvariantAdam])
def test_torch_compile_fit_equals_eager(make):
    # jit_compile=True (a model compiled so under JAX and loaded here keeps
    # it): the step is traced by torch.compile, where the driver reads the
    # window's bounds from the device (its Python count would be symbolic).
    x, y = data()
    nets = []
    for jit_compile in (False, True):
        net = model()
        net.compile(optimizer=make(0.01, steps=2), loss="mse", jit_compile=jit_compile)
        net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        nets.append(net)
    eager, compiled = nets
    assert int(keras.ops.convert_to_numpy(compiled.optimizer.iterations)) == 4
    for a, b in zip(eager.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_fit_equals_big_batch(inner):
    make = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
    accumulated = fitted(ka.GradientAccumulation(make[inner](), steps=4), 8)
    big = fitted(make[inner](), 32)
    assert_close(accumulated.get_weights(), big.get_weights(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [ka.UpdateAccumulationAdam, ka.InvariantAdam])
def test_steps_1_is_keras_adam(cls):
    ours = fitted(cls(0.01, steps=1, weight_decay=0.01), 8)
    keras_adam = fitted(keras.optimizers.Adam(0.01, weight_decay=0.01), 8)
    for a, b in zip(ours.get_weights(), keras_adam.get_weights()):
        if ADAM_EXACT:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fit_counts_updates():
    optimizer = ka.InvariantAdam(0.01, steps=4)
    fitted(optimizer, 8)  # 2 epochs x 4 micro-batches
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2
    assert int(keras.ops.convert_to_numpy(optimizer.micro_step)) == 8


@ends_mid_window  # saved 2 micro-batches into a window, asserted
@pytest.mark.parametrize(
    "make",
    [
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
        lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
        lambda: ka.InvariantAdam(0.01, steps=ka.PiecewiseSteps([4], [4, 2]), scaling_rule="power"),
        lambda: ka.InvariantAdam(  # 4 micro-steps of 8 examples: 25 rounds up to 4
            0.01, steps=ka.PiecewiseSteps([25], [4, 2], "examples", 8), scaling_rule="power"
        ),
    ],
    ids=["ga", "ua", "ia_schedule", "ia_schedule_examples"],
)
def test_save_mid_window_resumes(make, tmp_path):
    """Saved inside a window and loaded, training goes on as if never
    stopped (`.keras` file, the optimizer state with it)."""
    x, y = data()
    whole = model()
    whole.compile(optimizer=make(), loss="mse")
    whole.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)  # 12 micro-batches

    first = model()
    first.compile(optimizer=make(), loss="mse")
    first.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)  # 2, mid-window
    path = str(tmp_path / "mid.keras")
    first.save(path)
    resumed = keras.saving.load_model(path)
    assert resumed.optimizer.pending_micro_batches() == 2
    if not isinstance(first.optimizer.steps, int):  # the schedule, unit and all
        assert repr(resumed.optimizer.steps) == repr(first.optimizer.steps)
        assert resumed.optimizer.steps.get_config() == first.optimizer.steps.get_config()
    resumed.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_close(resumed.get_weights(), whole.get_weights(), rtol=1e-6, atol=1e-7)
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == int(
        keras.ops.convert_to_numpy(whole.optimizer.iterations)
    )


@pytest.mark.filterwarnings("error::DeprecationWarning")
@ends_mid_window
@pytest.mark.parametrize(
    "make",
    [
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
        lambda: ka.InvariantAdam(0.01, steps=ka.PiecewiseSteps([4], [4, 2])),
    ],
    ids=["ga", "ia_schedule"],
)
def test_fit_under_deprecation_warnings_as_errors(make):
    """A user's `filterwarnings = error`: NumPy 2 deprecates Keras's
    Variable.__array__, which the end of every `fit` went through to read
    the window's counters (mid-window and on a boundary)."""
    x, y = data()
    m = model()
    m.compile(optimizer=make(), loss="mse")
    m.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert m.optimizer.pending_micro_batches() == 2
    m.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert m.optimizer.pending_micro_batches() == 0
    assert int(m.optimizer.iterations) == 1


# -- what each backend refuses --------------------------------------------------------


@pytest.mark.skipif(BACKEND != "jax", reason="a compiled JAX step cannot raise")
def test_raise_policy_refused_under_jax():
    opt = ka.InvariantAdam(0.01, steps=2, nonfinite="raise")
    params = variables()
    with pytest.raises(ValueError, match="nonfinite='raise'"):
        opt.apply([keras.ops.ones(p.shape) for p in params], params)


def test_no_tensorflow_imported():
    """Training with the three optimizers, the schedules (`AdaptiveSteps`
    fed by the noise scale included), the scaling rules, the diagnostics
    and `rematerialize` imports no TensorFlow under JAX or PyTorch (run in
    a fresh process)."""
    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow is the backend")
    import subprocess

    script = """
import sys, numpy as np, keras, keras_accum as ka
from keras_accum import diagnostics
x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32"); y = x[:, :1] + 1

class Feed(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.optimizer.steps.observe(probe.tracker.b_simple)

for opt in [ka.GradientAccumulation(keras.optimizers.Adam(), steps=2),
            ka.UpdateAccumulationAdam(steps=2),
            ka.InvariantAdam(**ka.scale_hyperparameters(2, "power", 1e-3, 0.9, 0.999)),
            ka.InvariantAdam(1e-3, steps=ka.PiecewiseSteps([2], [1, 2]), scaling_rule="invariant"),
            ka.InvariantAdam(1e-3, steps=ka.AdaptiveSteps(1, 4, 4, min_observations=1,
                                                          noise_estimate="adam_preconditioned"))]:
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    m.compile(optimizer=opt, loss="mse")
    probe = diagnostics.NoiseScaleCallback((x, y), 4, 2, every_n_batches=2, seed=0)
    feed = [Feed()] if isinstance(opt.steps, ka.AdaptiveSteps) else []
    m.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[probe] + feed)
    assert np.isfinite(float(probe.tracker.b_simple))
light = ka.rematerialize(
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, "gelu"), keras.layers.Dense(1)]),
    "full")
light.compile(optimizer=ka.InvariantAdam(steps=2), loss="mse")
light.fit(x, y, batch_size=4, verbose=0)
assert ka.remat.mode_of(light) == "full"
tracker = opt.steps.noise_tracker()
tracker.update_from_micro_grads([[keras.ops.ones((3, 1))], [keras.ops.zeros((3, 1))]], 4)
print(opt.steps.decisions[-1], float(tracker.b_simple))
print(sorted(n for n in sys.modules if n.split(".")[0] == "tensorflow"))
"""
    env = dict(os.environ, KERAS_BACKEND=BACKEND)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_weigh_micro_batches_makes_a_short_last_batch_exact():
    """24 examples in micro-batches of 10, 10 and 4, one window: weighed by
    their item counts the window is the mean over the 24 examples (one SGD
    step on the whole batch); unweighed, the mean of the three means."""
    x, y = data(24)

    def trained(weigh, optimizer, batch_size):
        net = model()
        net.compile(optimizer=optimizer, loss="mse")
        if weigh:
            ka.weigh_micro_batches(net)
        net.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return net.get_weights()

    make = lambda: ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=3)
    big = trained(False, keras.optimizers.SGD(0.1), 24)
    assert_close(trained(True, make(), 10), big, rtol=1e-5, atol=1e-6)
    unweighed = trained(False, make(), 10)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(unweighed, big)) > 1e-3


def test_weigh_micro_batches_counts_a_zero_weight_micro_batch_as_zero_items():
    """Items 8-15 of 32 weigh zero under a token-mean loss: the second
    micro-batch of 8 adds nothing to the big batch's mean, and nothing to
    the window's count (0.3.0 counted it as one item)."""
    x, y = data(32)
    weights = np.ones(32, "float32")
    weights[8:16] = 0.0
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")

    def trained(optimizer, batch_size, weigh):
        net = model()
        net.compile(optimizer=optimizer, loss=loss)
        if weigh:
            ka.weigh_micro_batches(net)
        net.fit(x, y, sample_weight=weights, batch_size=batch_size, shuffle=False, verbose=0)
        return net.get_weights()

    big = trained(keras.optimizers.Adam(0.01), 16, False)
    accumulated = trained(ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2), 8, True)
    assert_close(accumulated, big, rtol=1e-5, atol=1e-6)


def test_weigh_micro_batches_makes_a_padded_token_mean_exact():
    """Sequences padded with 0 (an `Embedding` with `mask_zero`, so Keras's
    loss is the mean over unmasked tokens): micro-batches of 4 with unequal
    token counts, weighed by their tokens, equal the big batch's token mean
    (one SGD step on all 12 sequences), on every backend."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 7, size=12)
    ids = np.zeros((12, 6), "int32")
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(1, 9, size=length)
    targets = rng.integers(0, 9, size=(12, 6)).astype("int32")

    def trained(optimizer, batch_size, weigh):
        keras.utils.set_random_seed(0)
        net = keras.Sequential(
            [
                keras.Input((6,), dtype="int32"),
                keras.layers.Embedding(9, 4, mask_zero=True),
                keras.layers.Dense(9),
            ]
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        net.compile(optimizer=optimizer, loss=loss)
        if weigh:
            ka.weigh_micro_batches(net)
        net.fit(ids, targets, batch_size=batch_size, shuffle=False, verbose=0)
        return net.get_weights()

    big = trained(keras.optimizers.SGD(0.5), 12, False)
    weighed = trained(ka.GradientAccumulation(keras.optimizers.SGD(0.5), steps=3), 4, True)
    assert_close(weighed, big, rtol=1e-5, atol=1e-6)
    unweighed = trained(ka.GradientAccumulation(keras.optimizers.SGD(0.5), steps=3), 4, False)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(unweighed, big)) > 1e-4


def test_weighed_then_evaluated_then_recompiled_trains_as_never_weighed():
    """An evaluation records its count and no training step takes it (under
    JAX a value of a trace that has ended); a later compile without
    weighing, keeping the optimizer, must train as if never weighed."""
    x, y = data(24)

    def run(weigh_first):
        net = model()
        optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2)
        net.compile(optimizer=optimizer, loss="mse")
        if weigh_first:
            ka.weigh_micro_batches(net)
        # 4 micro-batches: the first fit ends on a window's end.
        net.fit(x, y, batch_size=6, shuffle=False, verbose=0, validation_data=(x, y))
        net.compile(optimizer=optimizer, loss="mse")  # no weighing from here on
        net.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # traced again
        return net.get_weights()

    assert_close(run(True), run(False), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's jitted step")
def test_jitted_custom_step_weighs_micro_batches_through_stateless_apply():
    """A jitted JAX step hands each micro-batch's item count to
    `stateless_apply(..., weight=n)`: micro-batches of 5, 3 and 2 items make
    one SGD step on the mean over all 10 (a numpy reference)."""
    import jax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = rng.normal(size=(10,)).astype("float32")
    w0 = rng.normal(size=(3,)).astype("float32")
    w = keras.Variable(w0)
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=3)
    optimizer.build([w])

    def mean_gradient(w, xs, ys):  # of the mean squared error over the items
        return jax.grad(lambda w: jax.numpy.mean((xs @ w - ys) ** 2))(w)

    @jax.jit
    def step(optimizer_variables, trainable, xs, ys, items):
        grads = [mean_gradient(trainable[0], xs, ys)]
        return optimizer.stateless_apply(optimizer_variables, grads, trainable, weight=items)

    state = [v.value for v in optimizer.variables]
    trainable = [w.value]
    for lo, hi in ((0, 5), (5, 8), (8, 10)):
        trainable, state = step(state, trainable, x[lo:hi], y[lo:hi], float(hi - lo))
    expected = w0 - 0.1 * (2 * x.T @ (x @ w0 - y) / 10)
    np.testing.assert_allclose(np.asarray(trainable[0]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow runs them")
@pytest.mark.parametrize("module", ["keras_accum.training", "keras_accum.experiments"])
def test_tensorflow_only_packages_say_so_at_import(module):
    import importlib

    with pytest.raises(RuntimeError, match=f"needs the TensorFlow backend.*{BACKEND}"):
        importlib.import_module(module)


@ends_mid_window  # the loss scaler's skipped micro-batches shift the windows
@pytest.mark.parametrize(
    "make",
    [
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
        lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
        lambda: ka.InvariantAdam(0.01, steps=4),
    ],
    ids=["ga", "ua", "ia"],
)
def test_mixed_float16_fit_under_the_loss_scale_optimizer(make):
    """`compile` wraps the optimizer in Keras's `LossScaleOptimizer`, which
    under JAX hands its inner optimizer variables, not values."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(64)
        keras.utils.set_random_seed(0)
        net = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")]
        )
        optimizer = make()
        net.compile(optimizer=optimizer, loss="mse")
        assert isinstance(net.optimizer, keras.optimizers.LossScaleOptimizer)
        history = net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # The loss scaler skips the micro-batches whose scaled gradient
    # overflows float16 (its scale starts at 2**15): they never reach the
    # optimizer, so the count of micro-steps may fall short of 16.
    micro_steps = int(keras.ops.convert_to_numpy(optimizer.micro_step))
    assert 12 <= micro_steps <= 16
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == micro_steps // 4
    assert np.isfinite(history.history["loss"][-1])


@pytest.mark.skipif(BACKEND == "tensorflow", reason="Keras's TF optimizer has no stateless_apply")
@pytest.mark.parametrize(
    "make",
    [
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2),
        lambda: ka.UpdateAccumulationAdam(0.1, steps=2),
        lambda: ka.InvariantAdam(0.1, steps=2),
    ],
    ids=["ga", "ua", "ia"],
)
def test_stateless_apply_writes_nothing_and_equals_apply(make, request):
    """`stateless_apply` returns the new values and leaves every variable
    as it was (PyTorch's in-place folds must not write through a
    `StatelessScope`); its values equal `apply`'s."""
    if BACKEND == "torch" and request.node.callspec.id == "ga":
        pytest.skip(
            "Keras's own PyTorch Adam writes its slots and the weights in place "
            "in stateless_apply (Keras 3.15.1): the inner optimizer of GA does"
        )
    params, twins = variables(), variables()
    optimizer, twin = make(), make()
    optimizer.build(params)
    twin.build(twins)
    state = [keras.ops.convert_to_numpy(v).copy() for v in optimizer.variables + params]
    optimizer_values = [v.value for v in optimizer.variables]
    trainable_values = [p.value for p in params]
    for grads in gradient_stream(4):
        grads = [keras.ops.convert_to_tensor(g) for g in grads]
        trainable_values, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable_values
        )
        twin.apply(grads, twins)
    for before, variable in zip(state, optimizer.variables + params):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), before)
    assert_close(
        [keras.ops.convert_to_numpy(v) for v in trainable_values], [t.numpy() for t in twins]
    )


@pytest.mark.skipif(BACKEND != "jax", reason="a traced step is JAX's")
def test_gradient_accumulation_traced_outside_stateless_apply_is_named():
    """Under `jax.jit`, `GradientAccumulation.apply` in a user's own
    `StatelessScope` cannot step its inner optimizer (that takes the
    `lax.cond` of `stateless_apply`): one line naming the way, not a
    silent window without an update."""
    import jax

    params = variables()
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2)
    optimizer.build(params)
    owned = optimizer.variables + params

    def step(values, grads):
        with keras.StatelessScope(state_mapping=list(zip(owned, values))):
            optimizer.apply(grads, params)
        return values

    values = [v.value for v in owned]
    grads = [keras.ops.convert_to_tensor(g) for g in next(gradient_stream(1))]
    with pytest.raises(RuntimeError, match=r"GradientAccumulation .*`stateless_apply`"):
        jax.jit(step)(values, grads)
    # The same step through `stateless_apply` runs.
    new_params, _ = jax.jit(optimizer.stateless_apply)(
        [v.value for v in optimizer.variables], grads, [p.value for p in params]
    )
    assert len(new_params) == len(params)
