"""Each fold is written once (its rule's functions) and run two ways
(`keras_accum/drivers/tensorflow/_execution.py`): in graph mode in `tf.cond` branches, under
XLA as arithmetic selects (`tf.where`). The two must agree.

The numpy-reference tests run the graph form; here the XLA form is checked
against it, state included, over windows with skipped (non-finite)
micro-batches at a window's start and in its middle.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka

NAN = float("nan")
MAKERS = {
    "gradient_accumulation": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=2),
    "gradient_accumulation_skip_micro_batch": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(0.1), steps=2, nonfinite="skip_micro_batch"
    ),
    "invariant_adam": lambda: ka.InvariantAdam(0.1, steps=2),
    "update_accumulation_adam": lambda: ka.UpdateAccumulationAdam(0.1, steps=2),
    "update_accumulation_adam_steps1": lambda: ka.UpdateAccumulationAdam(0.1, steps=1),
}


def _gradients():
    rng = np.random.default_rng(0)
    out = []
    for step in range(8):
        a, b = rng.standard_normal(3), rng.standard_normal((2, 2))
        if step in (2, 5):  # a window's first micro-batch; a middle one
            a[1] = NAN if step == 2 else np.inf
        out.append((a.astype("float32"), b.astype("float32")))
    return out


def _run(make, jit_compile):
    variables = [keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones((2, 2), "float32"))]
    optimizer = make()
    optimizer.build(variables)

    @tf.function(jit_compile=jit_compile)
    def step(a, b):
        optimizer.apply([a, b], variables)

    for a, b in _gradients():
        step(tf.constant(a), tf.constant(b))
    return [v.numpy() for v in variables], [v.numpy() for v in optimizer.variables]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_xla_masks_equal_graph_branches(name):
    graph_vars, graph_state = _run(MAKERS[name], jit_compile=False)
    xla_vars, xla_state = _run(MAKERS[name], jit_compile=True)
    assert all(np.isfinite(v).all() for v in graph_vars)
    for g, x in zip(graph_vars + graph_state, xla_vars + xla_state):
        # Same arithmetic; XLA may fuse a multiply-add differently.
        np.testing.assert_allclose(x, g, rtol=1e-6, atol=1e-7)
    # The two non-finite micro-batches were counted, not applied.


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_both_forms_count_the_skips(name):
    for jit_compile in (False, True):
        optimizer = MAKERS[name]()
        variables = [
            keras.Variable(np.ones(3, "float32")),
            keras.Variable(np.ones((2, 2), "float32")),
        ]
        optimizer.build(variables)
        step = tf.function(lambda a, b: optimizer.apply([a, b], variables), jit_compile=jit_compile)
        for a, b in _gradients():
            step(tf.constant(a), tf.constant(b))
        skipped = int(optimizer.skipped_micro_batches.numpy()), int(optimizer.skipped_updates)
        if optimizer.nonfinite == "skip_window":  # GradientAccumulation's default
            # Windows {2, 3} and {4, 5} dropped, checked on their sums.
            assert skipped == (0, 2), jit_compile
        else:
            assert skipped[0] == 2, jit_compile


def _decay():
    return keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)


# Under XLA (one replica) the window's end is computed every micro-step and
# kept by a select (`_execution.keep_where`), in graph mode it is a
# `tf.cond`: every feature that acts at the window's end must agree.
FEATURES = {
    "ga_adamw_ema_clip": lambda: ka.GradientAccumulation(
        keras.optimizers.AdamW(0.1, weight_decay=0.1, clipnorm=0.5, use_ema=True, ema_momentum=0.5),
        steps=2,
    ),
    "ga_ema_overwrite": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
        steps=2,
    ),
    "ga_sgd_nesterov": lambda: ka.GradientAccumulation(
        keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        steps=3,
        nonfinite="skip_micro_batch",
    ),
    "ga_amsgrad_schedule": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(_decay(), amsgrad=True), steps=2
    ),
    "ga_skip_window": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(0.1), steps=2, nonfinite="skip_window"
    ),
    "ga_piecewise": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(0.1), steps=ka.PiecewiseSteps([3], [1, 3])
    ),
    "ia_features": lambda: ka.InvariantAdam(
        _decay(), steps=2, weight_decay=0.1, clipnorm=0.5, use_ema=True, ema_momentum=0.5
    ),
    "ia_scaling_piecewise": lambda: ka.InvariantAdam(
        0.05, steps=ka.PiecewiseSteps([2], [1, 3]), scaling_rule="power"
    ),
    "ia_scaling_schedule": lambda: ka.InvariantAdam(
        _decay(), beta_1=0.8, beta_2=0.9, steps=2, scaling_rule="invariant"
    ),
    "uaa_features": lambda: ka.UpdateAccumulationAdam(
        0.1,
        steps=2,
        weight_decay=0.1,
        clipvalue=0.5,
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=2,
    ),
    "uaa_skip_window": lambda: ka.UpdateAccumulationAdam(0.1, steps=2, nonfinite="skip_window"),
    "uaa_piecewise": lambda: ka.UpdateAccumulationAdam(0.1, steps=ka.PiecewiseSteps([2], [1, 3])),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_xla_window_end_equals_graph_with_features(name):
    results = []
    for jit_compile in (False, True):
        variables = [
            keras.Variable(np.ones(3, "float32")),
            keras.Variable(np.ones((2, 2), "float32")),
        ]
        # |ones(3)| > 1: the constraint changes the variable at every update.
        variables[0].constraint = keras.constraints.MaxNorm(1.0)
        optimizer = FEATURES[name]()
        optimizer.build(variables)
        step = tf.function(lambda a, b: optimizer.apply([a, b], variables), jit_compile=jit_compile)
        for a, b in _gradients():
            step(tf.constant(a), tf.constant(b))
        results.append([v.numpy() for v in variables + list(optimizer.variables)])
    graph, xla = results
    assert len(graph) == len(xla)
    assert not np.allclose(graph[1], 1.0)  # the variables did move
    for g, x in zip(graph, xla):
        np.testing.assert_allclose(x, g, rtol=1e-5, atol=1e-6)
