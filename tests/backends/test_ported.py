"""Cases ported from the public test suites of Keras's optimizers
(keras/src/optimizers/*_test.py) and of optax's MultiSteps
(optax/transforms/_accumulation_test.py), written here against
tests/references.py or exact identities (steps=1 == keras Adam).

Backend-free: run under TensorFlow with the suite and under JAX and
PyTorch by `.ci/backends`; the sparse-gradient and retrace cases are
TensorFlow's (`tf.IndexedSlices`, `tf.function`)."""

import keras
import numpy as np
import pytest
import references
from keras import ops

import keras_accum as ka

ADAM_VARIANTS = {
    "invariant_adam": ka.InvariantAdam,
    "update_accumulation_adam": ka.UpdateAccumulationAdam,
}
ALL = {
    **ADAM_VARIANTS,
    "gradient_accumulation": lambda lr=0.1, steps=1, **kw: ka.GradientAccumulation(
        keras.optimizers.Adam(lr, **kw), steps=steps
    ),
}
TENSORFLOW_ONLY = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.IndexedSlices and tf.function"
)
RNG = np.random.default_rng(0)
INITS = [RNG.normal(size=3).astype("float32"), RNG.normal(size=(2, 2)).astype("float32")]
GRADS = [[RNG.normal(size=v.shape).astype("float32") * 2 for v in INITS] for _ in range(8)]


def make_variables(feature=None):
    variables = [keras.Variable(x, name=f"w{i}") for i, x in enumerate(INITS)]
    if feature == "constraint":
        variables[0].constraint = keras.constraints.NonNeg()
    if feature == "overwrite_with_gradient":
        scale = keras.Variable(np.ones(2, "float32"), name="scale")
        scale.overwrite_with_gradient = True
        variables.append(scale)
    return variables


def grads_for(variables, j, factor=1.0):
    grads = [ops.convert_to_tensor(g * factor) for g in GRADS[j]]
    if len(variables) > 2:  # the overwrite_with_gradient variable
        grads.append(ops.convert_to_tensor(np.full(2, 10.0 + j, "float32")))
    return grads


# -- keras: with steps=1, each feature behaves as in keras.optimizers.Adam ----

FEATURES = {
    "plain": {},
    "clipnorm": dict(clipnorm=0.5),
    "clipvalue": dict(clipvalue=0.3),
    "global_clipnorm": dict(global_clipnorm=0.7),
    "ema": dict(use_ema=True, ema_momentum=0.6),
    "ema_overwrite_frequency": dict(use_ema=True, ema_momentum=0.6, ema_overwrite_frequency=3),
    "loss_scale_factor": dict(loss_scale_factor=64.0),
    "weight_decay": dict(weight_decay=0.2),
    "constraint": {},
    "overwrite_with_gradient": {},
}


@pytest.mark.parametrize("name", ADAM_VARIANTS)
@pytest.mark.parametrize("feature", FEATURES)
def test_steps_1_equals_keras_adam(name, feature):
    kwargs = FEATURES[feature]
    factor = kwargs.get("loss_scale_factor", 1.0)
    ours_vars, theirs_vars = make_variables(feature), make_variables(feature)
    ours = ADAM_VARIANTS[name](0.05, steps=1, **kwargs)
    theirs = keras.optimizers.Adam(0.05, **kwargs)
    for j in range(6):
        ours.apply(grads_for(ours_vars, j, factor), ours_vars)
        theirs.apply(grads_for(theirs_vars, j, factor), theirs_vars)
        for a, b in zip(ours_vars, theirs_vars):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    if kwargs.get("use_ema"):
        ours.finalize_variable_values(ours_vars)
        theirs.finalize_variable_values(theirs_vars)
        for a, b in zip(ours_vars, theirs_vars):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert int(ours.iterations) == int(theirs.iterations) == 6


@pytest.mark.parametrize("name", ADAM_VARIANTS)
def test_weight_decay_exclusions_as_keras_adam(name):
    ours_vars, theirs_vars = make_variables(), make_variables()
    ours = ADAM_VARIANTS[name](0.05, weight_decay=0.3)
    theirs = keras.optimizers.Adam(0.05, weight_decay=0.3)
    for opt in (ours, theirs):
        opt.exclude_from_weight_decay(var_names=["w1"])
    for j in range(4):
        ours.apply(grads_for(ours_vars, j), ours_vars)
        theirs.apply(grads_for(theirs_vars, j), theirs_vars)
    for a, b in zip(ours_vars, theirs_vars):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ALL)
def test_config_round_trip_with_keras_arguments(name):
    opt = ALL[name](
        0.02, steps=2, clipnorm=0.5, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=4
    )
    config = opt.get_config()
    clone = type(opt).from_config(config)
    assert clone.get_config() == config
    inner = getattr(clone, "inner_optimizer", clone)
    assert (inner.clipnorm, inner.use_ema, inner.ema_overwrite_frequency) == (0.5, True, 4)


@pytest.mark.parametrize("name", ADAM_VARIANTS)
def test_only_one_clipping_argument(name):
    with pytest.raises(
        ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"
    ):
        ADAM_VARIANTS[name](clipnorm=1.0, clipvalue=1.0)


@pytest.mark.parametrize("name", ALL)
def test_single_step_by_hand(name):
    # Keras's adam_test single step: one update from zero moments is
    # lr * g / (|g| + eps * sqrt(1 - b2)) ~ lr * sign(g) per entry.
    var = keras.Variable(np.array([1.0, 2.0, 3.0, 4.0], "float32"))
    ALL[name](0.5).apply([ops.convert_to_tensor([0.1, -0.2, 0.3, 0.0])], [var])
    theta = references.Adam(0.5).apply(
        [np.array([1.0, 2.0, 3.0, 4.0])], [np.array([0.1, -0.2, 0.3, 0.0])]
    )
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5)
    np.testing.assert_allclose(var.numpy(), [0.5, 2.5, 2.5, 4.0], rtol=1e-4)


# -- keras features with steps > 1: the documented semantics ----------------------

CLIPS = [dict(clipnorm=0.5), dict(clipvalue=0.3), dict(global_clipnorm=0.7)]


@pytest.mark.parametrize("clipping", CLIPS, ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("name", ADAM_VARIANTS)
def test_clipping_acts_on_each_micro_batch(name, clipping):
    variables = make_variables()
    opt = ADAM_VARIANTS[name](0.05, steps=4, weight_decay=0.1, **clipping)
    if name == "invariant_adam":
        reference = references.InvariantAdam(0.05, 4, weight_decay=0.1, **clipping)
    else:
        reference = references.UpdateAccumulationAdam(0.05, 4, weight_decay=0.1, **clipping)
    theta = [x.astype("float64") for x in INITS]
    for j in range(8):
        opt.apply(grads_for(variables, j), variables)
        theta = reference.apply(theta, [g.astype("float64") for g in GRADS[j]])
        for a, b in zip(variables, theta):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ALL)
def test_constraint_acts_once_per_update(name):
    variables = make_variables("constraint")
    opt = ALL[name](0.3, steps=3)
    for j in range(6):
        before = [v.numpy().copy() for v in variables]
        opt.apply(grads_for(variables, j), variables)
        if (j + 1) % 3:
            for v, b in zip(variables, before):
                np.testing.assert_array_equal(v.numpy(), b)
        else:
            assert np.all(variables[0].numpy() >= 0)
    # The unconstrained run differs only by the clamp of the window's result.
    free = make_variables()
    free_opt = ALL[name](0.3, steps=3)
    for j in range(3):
        free_opt.apply(grads_for(free, j), free)
    constrained = make_variables("constraint")
    constrained_opt = ALL[name](0.3, steps=3)
    for j in range(3):
        constrained_opt.apply(grads_for(constrained, j), constrained)
    np.testing.assert_array_equal(constrained[0].numpy(), np.maximum(free[0].numpy(), 0))


@pytest.mark.parametrize("name", ADAM_VARIANTS)
def test_ema_acts_once_per_update(name):
    variables = make_variables()
    opt = ADAM_VARIANTS[name](0.05, steps=2, use_ema=True, ema_momentum=0.5)
    average = None
    for j in range(8):
        opt.apply(grads_for(variables, j), variables)
        if (j + 1) % 2 == 0:  # first update: average = theta (Keras's warm start)
            values = [v.numpy().astype("float64") for v in variables]
            average = (
                values if average is None else [0.5 * a + 0.5 * v for a, v in zip(average, values)]
            )
    opt.finalize_variable_values(variables)
    for v, a in zip(variables, average):
        np.testing.assert_allclose(v.numpy(), a, rtol=1e-6, atol=1e-7)


def test_ema_against_kerass_own_accumulation_exactly():
    """What `ema_momentum ** steps` matches of Keras's own accumulation, and
    what it does not, as identities over the weights after each update.

    Keras's `gradient_accumulation_steps` steps the EMA (momentum rho) at
    every micro-step, the weights standing still between updates; its
    `iterations` counts updates, so the first window's micro-steps copy the
    weights (v_1 after the first update). Just before update k+1 its
    average is the rho**steps EMA of v_1, .., v_k started at v_1 (call it
    A_k), and right after an update it has moved one micro-step toward the
    new weights: rho A_k + (1 - rho) v_(k+1).
    `GradientAccumulation(SGD(ema_momentum=rho**steps))` steps once per
    update, at the update: the rho**steps EMA of v_1, .., v_K. Equal just
    before each update; right after one (where `fit` ends) Keras's average
    lags the last update by the window's other micro-steps."""
    rho, steps, windows = 0.9, 4, 3
    keras_vars, ours_vars = make_variables()[:2], make_variables()[:2]
    keras_opt = keras.optimizers.SGD(
        0.1, use_ema=True, ema_momentum=rho, gradient_accumulation_steps=steps
    )
    ours = ka.GradientAccumulation(
        keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=rho**steps), steps=steps
    )
    after_updates = [[v.numpy().astype("float64") for v in ours_vars]]  # v_0
    for j in range(steps * windows):
        grads = grads_for(keras_vars, j % len(GRADS))
        keras_opt.apply(grads, keras_vars)
        ours.apply(grads, ours_vars)
        if (j + 1) % steps == 0:
            after_updates.append([v.numpy().astype("float64") for v in ours_vars])
        if (j + 2) % steps == 0 and j > steps:  # the micro-step before an update
            for a, b in zip(
                keras_opt._model_variables_moving_average,
                ours.inner_optimizer._model_variables_moving_average,
            ):
                np.testing.assert_allclose(
                    ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-5, atol=1e-6
                )
    for a, b in zip(keras_vars, ours_vars):  # the same weights: an equal-size window mean
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)

    def ema(values, momentum):
        average = values[0]
        for v in values[1:]:
            average = [momentum * a + (1 - momentum) * x for a, x in zip(average, v)]
        return average

    expected_ours = ema(after_updates[1:], rho**steps)
    a_k = ema(after_updates[1:-1], rho**steps)
    expected_keras = [rho * a + (1 - rho) * v for a, v in zip(a_k, after_updates[-1])]
    keras_average = [ops.convert_to_numpy(a) for a in keras_opt._model_variables_moving_average]
    ours_average = [
        ops.convert_to_numpy(a) for a in ours.inner_optimizer._model_variables_moving_average
    ]
    for got, want in zip(keras_average, expected_keras):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(ours_average, expected_ours):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Not the same average: the gap is of the order of one window's move.
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(keras_average, ours_average))
    move = max(float(np.max(np.abs(a - b))) for a, b in zip(after_updates[-1], after_updates[-2]))
    assert gap > 0.1 * move


@pytest.mark.parametrize("name", ALL)
def test_overwrite_with_gradient_takes_the_last_micro_batch(name):
    variables = make_variables("overwrite_with_gradient")
    opt = ALL[name](0.05, steps=3)
    for j in range(6):
        opt.apply(grads_for(variables, j), variables)
        expected = 1.0 if j < 2 else 10.0 + (2 if j < 5 else 5)
        np.testing.assert_array_equal(variables[2].numpy(), np.full(2, expected))
    # The other variables are unaffected by it.
    plain = make_variables()
    plain_opt = ALL[name](0.05, steps=3)
    for j in range(6):
        plain_opt.apply(grads_for(plain, j), plain)
    for a, b in zip(variables[:2], plain):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("name", ADAM_VARIANTS)
def test_loss_scale_factor_unscales_every_micro_batch(name):
    scaled, plain = make_variables(), make_variables()
    scaled_opt = ADAM_VARIANTS[name](0.05, steps=2, loss_scale_factor=256.0)
    plain_opt = ADAM_VARIANTS[name](0.05, steps=2)
    for j in range(4):
        scaled_opt.apply(grads_for(scaled, j, 256.0), scaled)
        plain_opt.apply(grads_for(plain, j), plain)
    for a, b in zip(scaled, plain):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    loss = ops.convert_to_tensor(2.0)
    assert float(scaled_opt.scale_loss(loss)) == 512.0


@TENSORFLOW_ONLY
@pytest.mark.parametrize("name", ALL)
def test_sparse_gradients_equal_dense(name):
    import tensorflow as tf

    dense_var = keras.Variable(np.ones((4, 2), "float32"))
    sparse_var = keras.Variable(np.ones((4, 2), "float32"))
    dense_opt, sparse_opt = ALL[name](0.1, steps=2), ALL[name](0.1, steps=2)
    for j in range(4):
        values = tf.constant(RNG.normal(size=(3, 2)), "float32")
        indices = tf.constant([j % 4, (j + 2) % 4, j % 4])  # a repeated row
        sparse = tf.IndexedSlices(values, indices, tf.constant([4, 2]))
        dense_opt.apply([tf.convert_to_tensor(sparse)], [dense_var])
        sparse_opt.apply([sparse], [sparse_var])
    np.testing.assert_allclose(sparse_var.numpy(), dense_var.numpy(), rtol=1e-6)


# -- optax MultiSteps ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_gradients_1_2_3_4_average_to_2_5(shape):
    var = keras.Variable(np.zeros(shape, "float32"))
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=4)
    for g in (1.0, 2.0, 3.0, 4.0):
        opt.apply([ops.full(shape, g, "float32")], [var])
    np.testing.assert_array_equal(var.numpy(), np.full(shape, -2.5))


@pytest.mark.parametrize("name", ALL)
def test_params_unchanged_off_boundary_and_counters(name):
    variables = make_variables()
    opt = ALL[name](0.05, steps=3)
    for j in range(7):
        before = [v.numpy().copy() for v in variables]
        opt.apply(grads_for(variables, j), variables)
        boundary = (j + 1) % 3 == 0
        assert bool(opt.has_updated()) == boundary
        assert int(opt.micro_step) == j + 1  # mini-step counter
        assert int(opt.iterations) == (j + 1) // 3  # update counter
        if not boundary:
            for v, b in zip(variables, before):
                np.testing.assert_array_equal(v.numpy(), b)


@pytest.mark.parametrize("name", ALL)
def test_skip_non_finite_window_leaves_params_and_state_finite(name):
    variables = make_variables()
    opt = ALL[name](0.05, steps=2)
    nan = [ops.full(v.shape, np.nan, "float32") for v in variables]
    before = [v.numpy().copy() for v in variables]
    opt.apply(nan, variables)
    opt.apply(nan, variables)
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    if opt.nonfinite == "skip_window":  # GradientAccumulation: the window's sums
        assert int(opt.skipped_updates) == 1
    else:
        assert int(opt.skipped_micro_batches.numpy()) == 2
    assert all(np.all(np.isfinite(w)) for w in opt.get_weights())


@TENSORFLOW_ONLY
@pytest.mark.parametrize("name", ALL)
def test_no_retrace_on_the_second_call(name):
    import tensorflow as tf

    variables = make_variables()
    opt = ALL[name](0.05, steps=2)
    opt.build(variables)
    traces = []

    @tf.function
    def step(grads):
        traces.append(1)
        opt.apply(grads, variables)

    for j in range(4):
        step(grads_for(variables, j))
    assert len(traces) == 1
    assert int(opt.iterations) == 2
