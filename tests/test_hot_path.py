"""The optimizers' two forms of the same step agree: graph mode folds with
branches (`tf.cond`), XLA with arithmetic masks (`tf.where`).

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
def test_both_forms_count_the_skipped_micro_batches(name):
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
        assert int(optimizer.skipped_micro_batches.numpy()) == 2, jit_compile
