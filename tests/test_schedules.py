"""Batch-size schedules: PiecewiseSteps, AdaptiveSteps and the optimizers
under them, against numpy references written from the equations (each
window k has its own kappa_k; tests/references.py)."""

import bisect

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import ends_mid_window, micro_steps, mirrored_strategy
from test_fit_and_saving import X, Y, build_model

import keras_accum as ka

# -- numpy references ---------------------------------------------------------


def np_window_sizes(boundaries, values, micro_steps):
    """Sizes of the windows covering `micro_steps` micro-batches: the window
    starting at s has values[#boundaries <= s] and finishes with it."""
    sizes, s = [], 0
    while s < micro_steps:
        sizes.append(values[bisect.bisect_right(boundaries, s)])
        s += sizes[-1]
    return sizes


def np_gradient_accumulation_adam(theta, windows, lr):
    """Keras Adam stepped once per window on the window's mean gradient."""
    adam = references.Adam(lr)
    for window in windows:
        [theta] = adam.apply([theta], [window.mean(0)])
    return theta


def np_update_accumulation_adam(theta, windows, lr):
    """Adam moments every micro-batch; the summed steps applied per window."""
    adam = references.Adam(lr)
    for window in windows:
        update = 0 * theta
        for g in window:
            [direction] = adam.fold([g])
            update = update + adam.alpha(adam.t) * direction
        theta = theta - update
    return theta


RULES = ["invariant", "power", "fixed_beta_1"]


@pytest.mark.parametrize("rule", RULES)
def test_reference_with_constant_kappa_is_the_scaled_one(rule):
    # P_i = beta_i,k ** k when kappa is constant: the scheduled reference is
    # then InvariantAdam's with scale_hyperparameters(kappa, rule).
    rng = np.random.default_rng(9)
    windows, theta = [rng.normal(size=(4, 3)) for _ in range(6)], rng.normal(size=3)
    scaled = ka.scale_hyperparameters(4, rule, 0.01, beta_1=0.9, beta_2=0.99)
    shared = references.InvariantAdam(
        scaled["learning_rate"], 4, b1=scaled["beta_1"], b2=scaled["beta_2"]
    )
    params = [theta]
    for g in np.concatenate(windows):
        params = shared.apply(params, [g])
    ours = references.scheduled_invariant_adam(theta, windows, 0.01, 0.9, 0.99, rule=rule)
    np.testing.assert_allclose(ours, params[0], rtol=1e-12)


# -- PiecewiseSteps -----------------------------------------------------------


def test_piecewise_value_at_each_micro_step():
    schedule = ka.PiecewiseSteps([3, 8], [1, 2, 4])
    for s in range(12):
        assert int(schedule(s)) == [1, 2, 4][bisect.bisect_right([3, 8], s)]
    assert int(ka.PiecewiseSteps([], [5])(7)) == 5
    assert (schedule.min_steps, schedule.max_steps) == (1, 4)


@pytest.mark.parametrize(
    "boundaries, values, match",
    [
        ([3], [1], "one more entry"),
        ([3, 3], [1, 2, 4], "strictly increasing"),
        ([5, 2], [1, 2, 4], "strictly increasing"),
        ([0], [1, 2], "boundaries"),
        ([2], [1, 0], "values"),
        ([2], [1, 2.5], "values"),
        ("12", [1, 2, 3], "boundaries"),
        ([], [], "values"),
    ],
)
def test_piecewise_refuses_bad_arguments(boundaries, values, match):
    with pytest.raises(ValueError, match=match):
        ka.PiecewiseSteps(boundaries, values)


# Each bad input of the units: (arguments, the start of the one-line error).
BAD_UNITS = [
    ({"unit": "samples"}, "`unit` must be one of 'micro_steps', 'examples', 'tokens'"),
    ({"unit": None}, "`unit` must be one of"),
    ({"unit": "examples"}, "`micro_batch_size` must be an integer >= 1 with unit='examples'"),
    ({"unit": "examples", "micro_batch_size": 0}, "`micro_batch_size` must be an integer >= 1"),
    ({"unit": "examples", "micro_batch_size": -32}, "`micro_batch_size` must be an integer >= 1"),
    ({"unit": "examples", "micro_batch_size": 2.5}, "`micro_batch_size` must be an integer >= 1"),
    ({"unit": "examples", "micro_batch_size": True}, "`micro_batch_size` must be an integer >= 1"),
    ({"unit": "tokens"}, "`tokens_per_micro_batch` must be an integer >= 1 with unit='tokens'"),
    ({"unit": "tokens", "tokens_per_micro_batch": 0}, "`tokens_per_micro_batch` must be"),
    ({"micro_batch_size": 32}, "`micro_batch_size` is only used with unit='examples'"),
    ({"tokens_per_micro_batch": 64}, "`tokens_per_micro_batch` is only used with unit='tokens'"),
    (
        {"unit": "tokens", "micro_batch_size": 32, "tokens_per_micro_batch": 64},
        "`micro_batch_size` is only used with unit='examples'; here unit='tokens'",
    ),
    (
        {"unit": "examples", "micro_batch_size": 32, "boundaries": [64, 64]},
        "`boundaries` must be strictly increasing",
    ),
    (
        {"unit": "examples", "micro_batch_size": 32, "boundaries": [0, 64]},
        "`boundaries` must be a list of integers >= 1",
    ),
    (
        {"unit": "examples", "micro_batch_size": 32, "boundaries": [64.0, 128]},
        "`boundaries` must be a list of integers >= 1",
    ),
    (  # 40 and 64 examples both switch at micro-step 2: values[1] never used
        {"unit": "examples", "micro_batch_size": 32, "boundaries": [40, 64]},
        "`boundaries` 40 and 64 (examples) both switch at micro-step 2",
    ),
    (
        {"unit": "tokens", "tokens_per_micro_batch": 1024, "boundaries": [1, 1024]},
        "`boundaries` 1 and 1024 (tokens) both switch at micro-step 1",
    ),
]


@pytest.mark.parametrize("kwargs, message", BAD_UNITS, ids=[m for _, m in BAD_UNITS])
def test_piecewise_units_refuse_bad_arguments_in_one_line(kwargs, message):
    kwargs = {"boundaries": [64, 128], "values": [1, 2, 4], **kwargs}
    with pytest.raises(ValueError) as error:
        ka.PiecewiseSteps(**kwargs)
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text, text
    name = message.split("`")[1]  # the argument named, its value echoed
    assert f"Received: {name}=" in text, text


@pytest.mark.parametrize("steps", [0, 1.5, "4", None, [1, 2]])
def test_optimizers_refuse_bad_steps(steps):
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
        ka.InvariantAdam(steps=steps)


def test_config_round_trip():
    schedule = ka.PiecewiseSteps([3, 8], [1, 2, 4])
    examples = ka.PiecewiseSteps([9, 17], [1, 2, 4], unit="examples", micro_batch_size=4)
    tokens = ka.PiecewiseSteps([100], [1, 4], unit="tokens", tokens_per_micro_batch=64)
    for opt in (
        ka.InvariantAdam(0.01, steps=schedule, scaling_rule="power"),
        ka.InvariantAdam(0.01, steps=examples, scaling_rule="power"),
        ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=tokens),
        ka.InvariantAdam(
            0.01,
            steps=ka.AdaptiveSteps(
                1, 8, 16, warmup=ka.PiecewiseSteps([50], [1, 2], "examples", 16)
            ),
        ),
        ka.UpdateAccumulationAdam(0.01, steps=schedule),
        ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=schedule),
        ka.InvariantAdam(0.01, steps=ka.AdaptiveSteps(1, 8, 32), scaling_rule="invariant"),
        ka.InvariantAdam(
            0.01,
            steps=ka.AdaptiveSteps(2, 8, 16, 0.5, 3, warmup=ka.PiecewiseSteps([4], [1, 4])),
            scaling_rule="power",
        ),
    ):
        clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
        assert type(clone.steps) is type(opt.steps)
        assert clone.steps.get_config() == opt.steps.get_config()
        assert clone.get_config() == opt.get_config()
        assert repr(clone.steps) == repr(opt.steps)
        warmup = getattr(opt.steps, "warmup", None)
        for original, copy in [
            (opt.steps, clone.steps),
            (warmup, getattr(clone.steps, "warmup", None)),
        ]:
            if isinstance(original, ka.PiecewiseSteps):
                assert copy.micro_step_boundaries == original.micro_step_boundaries
    # The config of each spelling, as written (micro-steps: as before units).
    assert schedule.get_config() == {"boundaries": [3, 8], "values": [1, 2, 4]}
    assert examples.get_config() == {
        "boundaries": [9, 17],
        "values": [1, 2, 4],
        "unit": "examples",
        "micro_batch_size": 4,
    }
    assert ka.PiecewiseSteps.from_config(tokens.get_config()).micro_step_boundaries == [2]
    # A config written before units loads as micro-steps.
    old = ka.PiecewiseSteps.from_config({"boundaries": [3, 8], "values": [1, 2, 4]})
    assert (old.unit, old.micro_step_boundaries) == ("micro_steps", [3, 8])


def test_adaptive_warmup_in_examples_hands_over_at_its_micro_step():
    # The warmup's last boundary, 50 examples of 16: micro-step ceil(50 / 16) = 4.
    warmup = ka.PiecewiseSteps([20, 50], [1, 2, 4], unit="examples", micro_batch_size=16)
    schedule = ka.AdaptiveSteps(1, 8, 16, warmup=warmup)
    ka.InvariantAdam(0.01, steps=schedule).build([keras.Variable(np.zeros(2, "float32"))])
    assert [int(schedule(s)) for s in range(6)] == [1, 1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match=r"^`warmup` in examples must have .*micro_batch_size=32"):
        ka.AdaptiveSteps(1, 8, 32, warmup=warmup)


# -- the optimizers under a schedule, step by step ---------------------------

# Windows of 1, 1, 1, 2, 2 (the one starting at 5 crosses the boundary 6 and
# keeps its size), 4, 4 micro-batches.
BOUNDARIES, VALUES = [3, 6], [1, 2, 4]


def run_schedule(opt, rng, shape=(3, 2)):
    """Feeds the optimizer through 15 micro-batches in a tf.function;
    returns (theta0, windows fed, theta after each window, traces)."""
    theta = rng.normal(size=shape)
    var = keras.Variable(theta.astype("float32"))
    opt.build([var])
    step = tf.function(lambda g: opt.apply([g], [var]))
    sizes = np_window_sizes(BOUNDARIES, VALUES, 15)
    windows, after = [], []
    for size in sizes:
        window = rng.normal(size=(size, *shape))
        for j, g in enumerate(window):
            before = var.numpy().copy()
            step(tf.constant(g, "float32"))
            if j < size - 1:  # no movement inside a window, bit for bit
                np.testing.assert_array_equal(var.numpy(), before)
            assert int(opt.window_steps) == size
        windows.append(window)
        after.append(var.numpy().copy())
    assert int(opt.iterations) == len(sizes)
    return theta, windows, after, step.experimental_get_tracing_count()


# With `decay_and_ema`, the weights' average uses momentum rho ** kappa_k
# under a rule and the decay is lr_k * weight_decay.
DECAY_AND_EMA = {"weight_decay": 0.5, "use_ema": True, "ema_momentum": 0.7}


@pytest.mark.parametrize("decay_and_ema", [False, True])
@pytest.mark.parametrize("rule", [None, *RULES])
def test_invariant_adam_matches_reference(rule, decay_and_ema):
    extra = DECAY_AND_EMA if decay_and_ema else {}
    opt = ka.InvariantAdam(
        0.02,
        beta_1=0.8,
        beta_2=0.95,
        steps=ka.PiecewiseSteps(BOUNDARIES, VALUES),
        scaling_rule=rule,
        **extra,
    )
    theta, windows, after, traces = run_schedule(opt, np.random.default_rng(1))
    assert sorted({len(w) for w in windows}) == [1, 2, 4]
    assert traces == 1  # the size changes without retracing
    reference = {"weight_decay": 0.5, "ema": 0.7} if decay_and_ema else {}
    for k in range(len(windows)):
        expected = references.scheduled_invariant_adam(
            theta, windows[: k + 1], 0.02, 0.8, 0.95, rule=rule, **reference
        )
        if decay_and_ema:
            expected, average = expected
        np.testing.assert_allclose(after[k], expected, rtol=1e-5, atol=1e-6)
    if decay_and_ema:
        [ours] = opt._model_variables_moving_average
        np.testing.assert_allclose(ours.numpy(), average, rtol=1e-5, atol=1e-6)


def test_invariant_rule_lr_schedule_sees_micro_batches_consumed():
    # lr = 0.02 for the first 4 micro-batches consumed, then 0.005: a
    # schedule written for kappa = 1 keeps its meaning when kappa changes.
    lr = keras.optimizers.schedules.PiecewiseConstantDecay([4], [0.02, 0.005])
    opt = ka.InvariantAdam(
        lr, steps=ka.PiecewiseSteps(BOUNDARIES, VALUES), scaling_rule="invariant"
    )
    theta, windows, after, _ = run_schedule(opt, np.random.default_rng(2))

    def lr_fn(n):  # PiecewiseConstantDecay: 0.02 while n <= 4
        return 0.02 if n <= 4 else 0.005

    expected = references.scheduled_invariant_adam(
        theta, windows, None, 0.9, 0.999, rule="invariant", lr_fn=lr_fn
    )
    np.testing.assert_allclose(after[-1], expected, rtol=1e-5, atol=1e-6)


def _apply_both(opt, ref, rng, micro_batches, jit=False):
    """Feeds the same gradients to two optimizers on twin variables (in a
    tf.function, XLA-compiled with `jit`); returns both variables and EMAs."""
    init = rng.normal(size=(4, 3)).astype("float32")
    ours, theirs = keras.Variable(init), keras.Variable(init)
    opt.build([ours])
    ref.build([theirs])
    step = tf.function(
        lambda g: (opt.apply([g], [ours]), ref.apply([g], [theirs])), jit_compile=jit
    )
    for _ in range(micro_batches):
        step(tf.constant(rng.normal(size=(4, 3)), "float32"))
    averages = [o._model_variables_moving_average[0].numpy() for o in (opt, ref)]
    return (ours.numpy(), theirs.numpy()), averages


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rule", RULES)
def test_constant_steps_rule_equals_scaled_hyperparameters(rule, jit):
    # The identity: scaling_rule=r with steps=kappa is the same
    # optimizer with scale_hyperparameters(kappa, r) (EMA rho ** kappa,
    # weight decay per example kept), to float32 rounding.
    rng = np.random.default_rng(3)
    opt = ka.InvariantAdam(
        0.01,
        beta_1=0.9,
        beta_2=0.99,
        steps=4,
        scaling_rule=rule,
        weight_decay=0.1,
        use_ema=True,
        ema_momentum=0.8,
    )
    scaled = ka.scale_hyperparameters(
        4, rule, 0.01, beta_1=0.9, beta_2=0.99, weight_decay=0.1, ema_momentum=0.8
    )
    assert scaled["ema_momentum"] == pytest.approx(0.8**4)
    assert scaled["weight_decay"] == 0.1  # lr x kappa: the same per example
    ref = ka.InvariantAdam(steps=4, use_ema=True, **scaled)
    (ours, theirs), (avg_ours, avg_theirs) = _apply_both(opt, ref, rng, 6 * 4, jit)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(avg_ours, avg_theirs, rtol=1e-5, atol=1e-7)


def test_fixed_beta_1_is_adam_with_kappa_lr_and_beta_2_to_the_kappa():
    # scaling_rule="fixed_beta_1" at steps=kappa: lr x kappa, beta_1 and
    # epsilon kept, beta_2 ** kappa, written out by hand.
    kappa, rng = 4, np.random.default_rng(6)
    opt = ka.InvariantAdam(
        0.003, beta_1=0.9, beta_2=0.99, epsilon=1e-6, steps=kappa, scaling_rule="fixed_beta_1"
    )
    ref = ka.InvariantAdam(kappa * 0.003, beta_1=0.9, beta_2=0.99**kappa, epsilon=1e-6, steps=kappa)
    init = rng.normal(size=(4, 3)).astype("float32")
    ours, theirs = keras.Variable(init), keras.Variable(init)
    for _ in range(5 * kappa):
        g = tf.constant(rng.normal(size=(4, 3)), "float32")
        opt.apply([g], [ours])
        ref.apply([g], [theirs])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)


def test_update_accumulation_adam_matches_reference():
    opt = ka.UpdateAccumulationAdam(0.02, steps=ka.PiecewiseSteps(BOUNDARIES, VALUES))
    theta, windows, after, traces = run_schedule(opt, np.random.default_rng(4))
    assert traces == 1
    for k in range(len(windows)):
        expected = np_update_accumulation_adam(theta, windows[: k + 1], 0.02)
        np.testing.assert_allclose(after[k], expected, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_matches_reference():
    opt = ka.GradientAccumulation(
        keras.optimizers.Adam(0.02), steps=ka.PiecewiseSteps(BOUNDARIES, VALUES)
    )
    theta, windows, after, traces = run_schedule(opt, np.random.default_rng(5))
    assert traces == 1
    for k in range(len(windows)):
        expected = np_gradient_accumulation_adam(theta, windows[: k + 1], 0.02)
        np.testing.assert_allclose(after[k], expected, rtol=1e-5, atol=1e-6)


# -- the beta <= 0 refusal ----------------------------------------------------


def test_linear_rule_refuses_beta_at_or_below_zero():
    steps = ka.PiecewiseSteps([10], [1, 16])  # 16 * (1 - 0.9) >= 1
    with pytest.raises(ValueError, match=r"beta_1 .*<= 0.*kappa=16.*scaling_rule='power'"):
        ka.InvariantAdam(beta_1=0.9, steps=steps, scaling_rule="invariant")
    with pytest.raises(ValueError, match="beta_2"):
        ka.InvariantAdam(beta_1=0.99, beta_2=0.9, steps=16, scaling_rule="invariant")
    # The power rule and no rule accept it.
    ka.InvariantAdam(beta_1=0.9, steps=steps, scaling_rule="power")
    ka.InvariantAdam(beta_1=0.9, steps=steps)
    with pytest.raises(ValueError, match="scaling_rule"):
        ka.InvariantAdam(scaling_rule="sqrt")


def test_linear_rule_refused_at_build_with_the_replica_count():
    # 8 micro-batches per replica pass alone (0.8) but not on 2 replicas.
    strategy = mirrored_strategy()
    with strategy.scope():
        var = keras.Variable(np.zeros(2, "float32"))
        opt = ka.InvariantAdam(
            beta_1=0.9, steps=ka.PiecewiseSteps([4], [1, 8]), scaling_rule="invariant"
        )
        with pytest.raises(ValueError, match="beta_1.*kappa=16"):
            opt.build([var])


# -- model.fit: save/load across a switch, MirroredStrategy -------------------

# The data and model of the model.fit tests (tests/test_fit_and_saving.py).


MAKERS = {
    "invariant_adam": lambda s: ka.InvariantAdam(0.01, steps=s, scaling_rule="invariant"),
    "invariant_adam_power": lambda s: ka.InvariantAdam(0.01, steps=s, scaling_rule="power"),
    "invariant_adam_fixed_beta_1_ema": lambda s: ka.InvariantAdam(
        0.01,
        steps=s,
        scaling_rule="fixed_beta_1",
        weight_decay=0.01,
        use_ema=True,
        ema_momentum=0.9,
    ),
    "update_accumulation_adam": lambda s: ka.UpdateAccumulationAdam(0.01, steps=s),
    "gradient_accumulation": lambda s: ka.GradientAccumulation(
        keras.optimizers.AdamW(0.01, weight_decay=0.01), steps=s
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        "invariant_adam",
        "invariant_adam_fixed_beta_1_ema",
        "update_accumulation_adam",
        "gradient_accumulation",
    ],
)
@ends_mid_window
def test_save_and_load_mid_window_across_a_switch(name, tmp_path):
    # Windows of 2, 2, 4, 4: micro-step 3 is inside the second window, past
    # the boundary but still of size 2; micro-step 5 inside the first of 4.
    x, y = np.concatenate([X, X]), np.concatenate([Y, Y])
    parts = [slice(0, 12), slice(12, 20), slice(20, 56)]  # micro-steps 3, 5, 14

    def fit_part(model, part):
        model.fit(x[parts[part]], y[parts[part]], batch_size=4, shuffle=False, verbose=0)

    model = build_model()
    model.compile(optimizer=MAKERS[name](ka.PiecewiseSteps([3], [2, 4])), loss="mse")
    for part, saved_at in enumerate([3, 5]):
        fit_part(model, part)
        assert int(model.optimizer.micro_step) == saved_at
        model.save(str(tmp_path / f"at_{saved_at}.keras"))
    fit_part(model, 2)
    assert int(model.optimizer.iterations) == 4

    for first_part, saved_at in enumerate([3, 5], start=1):
        restored = keras.models.load_model(str(tmp_path / f"at_{saved_at}.keras"))
        assert type(restored.optimizer.steps) is ka.PiecewiseSteps
        assert int(restored.optimizer.micro_step) == saved_at
        assert int(restored.optimizer.window_steps) == (2 if saved_at == 3 else 4)
        for part in range(first_part, 3):
            fit_part(restored, part)
        assert int(restored.optimizer.iterations) == 4
        for a, b in zip(restored.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


# Twins: windows of 1 until micro-step 4, 2 until 8, then 4, in micro-steps
# and (micro-batches of 4 examples, of 4 x 16 tokens) in examples and tokens
# that are not multiples of a micro-batch: 13 and 29 examples round up to
# micro-steps 4 and 8, as do 193 and 449 tokens. 24 micro-batches: 10 windows.
TWINS = {
    "micro_steps": lambda: ka.PiecewiseSteps([4, 8], [1, 2, 4]),
    "examples": lambda: ka.PiecewiseSteps([13, 29], [1, 2, 4], "examples", micro_batch_size=4),
    "tokens": lambda: ka.PiecewiseSteps([193, 449], [1, 2, 4], "tokens", tokens_per_micro_batch=64),
}


@pytest.mark.parametrize("name", ["invariant_adam_fixed_beta_1_ema", "gradient_accumulation"])
def test_examples_and_tokens_spellings_train_the_same_model(name):
    runs = {unit: fit(lambda: MAKERS[name](make()), 4) for unit, make in TWINS.items()}
    windows = np.cumsum(np_window_sizes([4, 8], [1, 2, 4], 24))  # 24 micro-batches
    assert (
        [int(m.optimizer.iterations) for m in runs.values()] == [sum(windows <= 24)] * 3 == [10] * 3
    )
    reference = runs.pop("micro_steps").get_weights()
    for model in runs.values():
        for a, b in zip(model.get_weights(), reference):
            np.testing.assert_array_equal(a, b)


def test_save_and_load_mid_run_keeps_a_schedule_in_examples(tmp_path):
    # Saved at micro-step 5, inside the window of 2 that starts at 4 (13
    # examples rounded up), loaded with its unit and continued: the same
    # weights as the uninterrupted micro-step twin.
    whole = fit(lambda: MAKERS["invariant_adam"](TWINS["micro_steps"]()), 4)
    model = build_model()
    model.compile(optimizer=MAKERS["invariant_adam"](TWINS["examples"]()), loss="mse")
    model.fit(X[:20], Y[:20], batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.micro_step) == 5 and int(model.optimizer.window_steps) == 2
    model.save(str(tmp_path / "examples.keras"))
    restored = keras.models.load_model(str(tmp_path / "examples.keras"))
    steps = restored.optimizer.steps
    assert type(steps) is ka.PiecewiseSteps
    assert steps.get_config() == TWINS["examples"]().get_config()
    assert (steps.unit, steps.micro_batch_size) == ("examples", 4)
    assert steps.micro_step_boundaries == [4, 8]
    assert int(restored.optimizer.window_steps) == 2
    restored.fit(X[20:], Y[20:], batch_size=4, shuffle=False, verbose=0)
    restored.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations) == int(whole.optimizer.iterations) == 10
    for a, b in zip(restored.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)


def fit(optimizer, batch_size, strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=optimizer(), loss="mse")
    model.fit(X, Y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(
    "name", ["invariant_adam", "invariant_adam_fixed_beta_1_ema", "gradient_accumulation"]
)
def test_mirrored_equals_one_device_with_schedule_doubled(name):
    # Two replicas x windows of 1 then 2 micro-batches per replica is one
    # device with windows of 2 then 4 (boundaries in micro-steps doubled).
    make = MAKERS[name]
    model = fit(lambda: make(ka.PiecewiseSteps([2], [1, 2])), 8, mirrored_strategy())
    reference = fit(lambda: make(ka.PiecewiseSteps([4], [2, 4])), 4)
    assert model.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy() == 7
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if model.optimizer.use_ema:  # rho ** kappa_k with kappa_k = steps x replicas
        averages = [
            o._model_variables_moving_average for o in (model.optimizer, reference.optimizer)
        ]
        for a, b in zip(*averages):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_mirrored_examples_are_global():
    # micro_batch_size counts examples over all replicas (fit's batch_size):
    # on 2 replicas at batch 8, 16 examples is micro-step 2, the micro-step
    # twin exactly; and one device at batch 4 with the same boundary in
    # examples (micro-step 4, windows twice as long) trains the same model.
    make = MAKERS["invariant_adam"]
    strategy = mirrored_strategy()
    model = fit(lambda: make(ka.PiecewiseSteps([16], [1, 2], "examples", 8)), 8, strategy)
    twin = fit(lambda: make(ka.PiecewiseSteps([2], [1, 2])), 8, strategy)
    one_device = fit(lambda: make(ka.PiecewiseSteps([16], [2, 4], "examples", 4)), 4)
    assert int(model.optimizer.iterations.numpy()) == 7
    assert int(one_device.optimizer.iterations.numpy()) == 7
    for a, b, c in zip(model.get_weights(), twin.get_weights(), one_device.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_mirrored_update_accumulation_adam_with_schedule():
    # Replicas share the moments: a mirrored micro-step is one global batch.
    make = MAKERS["update_accumulation_adam"]
    model = fit(lambda: make(ka.PiecewiseSteps([2], [1, 2])), 8, mirrored_strategy())
    reference = fit(lambda: make(ka.PiecewiseSteps([2], [1, 2])), 8)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- AdaptiveSteps ------------------------------------------------------------


def test_adaptive_steps_follow_the_noise_scale_and_never_decrease():
    # Unsmoothed and deciding at once: the rule on each estimate alone.
    schedule = ka.AdaptiveSteps(1, 8, 32, smoothing=0.0, min_observations=1)
    opt = ka.InvariantAdam(0.01, steps=schedule, scaling_rule="power")
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    assert int(schedule(0)) == 1
    # steps = max(steps, clip(ceil(B_simple / 32), 1, 8))
    for b_simple, expected in [
        (float("nan"), 1),  # no estimate yet: unchanged
        (70.0, 3),
        (40.0, 3),  # never decreasing
        (float("inf"), 8),  # signal not resolved: the largest window
        (1e6, 8),
    ]:
        assert int(schedule.observe(b_simple)) == expected
    assert [d.steps for d in schedule.decisions] == [1, 3, 3, 8, 8]
    assert schedule.decisions[1].b_simple == 70.0
    with pytest.raises(ValueError, match="max_steps"):
        ka.AdaptiveSteps(min_steps=4, max_steps=2)
    with pytest.raises(ValueError, match="not built"):
        ka.AdaptiveSteps().observe(3.0)


@ends_mid_window
def test_adaptive_steps_change_at_window_starts_and_are_saved(tmp_path):
    model = build_model()
    steps = ka.AdaptiveSteps(1, 4, 4, smoothing=0.0, min_observations=1)
    model.compile(optimizer=MAKERS["invariant_adam"](steps), loss="mse")
    opt = model.optimizer

    def fit_batches(model, lo, hi):
        model.fit(X[4 * lo : 4 * hi], Y[4 * lo : 4 * hi], batch_size=4, shuffle=False, verbose=0)

    fit_batches(model, 0, 2)  # two windows of 1
    opt.steps.observe(7.0)  # ceil(7 / 4) = 2 from the next window on
    fit_batches(model, 2, 3)  # first micro-batch of a window of 2
    assert int(opt.window_steps) == 2 and int(opt.iterations) == 2
    opt.steps.observe(16.0)  # 4, but the window in progress keeps 2
    model.save(str(tmp_path / "adaptive.keras"))
    fit_batches(model, 3, 8)  # ends the window of 2, then one of 4
    assert int(opt.window_steps) == 4 and int(opt.iterations) == 4

    restored = keras.models.load_model(str(tmp_path / "adaptive.keras"))
    assert int(restored.optimizer.steps.steps) == 4
    assert int(restored.optimizer.window_steps) == 2
    fit_batches(restored, 3, 8)
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- the custom loop (keras_accum.training.Trainer) ---------------------------


def test_custom_loop_resumes_mid_window_across_a_switch(tmp_path):
    # Trainer.micro_batch_step on 2 replicas, one global micro-batch of 4 per call;
    # windows of 2, 2, 4, 4 calls. Saved at 5 calls (inside the first window
    # of 4; the fit test also saves before the switch), restored into fresh
    # objects, continued to 12: equal to the uninterrupted run.
    from keras_accum import training

    strategy = mirrored_strategy()
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)

    def fresh():
        with strategy.scope():
            model = build_model()
            opt = ka.InvariantAdam(
                0.01, steps=ka.PiecewiseSteps([3], [2, 4]), scaling_rule="invariant"
            )
            return training.Trainer(model, opt, "mse", strategy=strategy)

    uninterrupted = fresh()
    micro_steps(uninterrupted, dataset, 12)
    assert int(uninterrupted.optimizer.iterations.numpy()) == 4
    with pytest.raises(ValueError, match="schedule.*micro_batch_step"):
        uninterrupted.train_step(iter(uninterrupted.distribute(dataset)))
    for saved_at in (5,):
        first = fresh()
        micro_steps(first, dataset, saved_at)
        first.save(str(tmp_path / str(saved_at)))
        resumed = fresh()
        assert resumed.restore(str(tmp_path / str(saved_at)))
        assert int(resumed.optimizer.window_steps.numpy()) == (2 if saved_at == 3 else 4)
        micro_steps(resumed, dataset, 12 - saved_at)
        for a, b in zip(resumed.model.get_weights(), uninterrupted.model.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
