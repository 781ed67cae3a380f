"""A weight of 0 (issue #51): a micro-batch whose items all weigh zero (a
padding-only micro-batch) adds nothing to its window's weighted mean and
still counts as a micro-step, the same on every backend and every route:
an eager `apply(weight=0)` (a number or a scalar tensor), a traced weight
(JAX's jitted `stateless_apply`) and `weigh_micro_batches` under `fit`. A
window whose weights add up to 0 steps the inner optimizer with a zero
mean gradient (the W = 0 guard of `GradientAccumulation.means`: the big
batch's mean, whose loss Keras divides with `divide_no_nan`, is 0 too).
Checked against a numpy reference of SGD with momentum, which moves the
variables even on a zero gradient: a window that did not step would show.
"""

import keras
import numpy as np
import pytest

import keras_accum as ka

BACKEND = keras.backend.backend()
LR, MOMENTUM, STEPS, MICRO = 0.1, 0.9, 2, 4

rng = np.random.default_rng(0)
X = rng.normal(size=(24, 3)).astype("float32")
Y = rng.normal(size=(24, 1)).astype("float32")
# Micro-batches of 4: the 2nd weighs nothing (window 1 weighs 4 + 0), the
# 3rd and 4th weigh nothing (window 2 weighs 0), two items of the 6th do.
SAMPLE_WEIGHTS = np.ones(24, "float32")
SAMPLE_WEIGHTS[4:16] = 0.0
SAMPLE_WEIGHTS[21:23] = 0.0
W0 = rng.normal(size=(3, 1)).astype("float32")
B0 = np.zeros((1,), "float32")


def mean_gradient(w, b, lo, hi):
    """The gradient of Keras's mse with reduction "mean_with_sample_weight"
    over items lo:hi: sum_i s_i d(err_i^2) / sum_i s_i, 0 when the sum is
    0 (`divide_no_nan`)."""
    x, y, s = X[lo:hi].astype("float64"), Y[lo:hi].astype("float64"), SAMPLE_WEIGHTS[lo:hi]
    items = float(s.sum())
    if items == 0.0:
        return np.zeros_like(w), np.zeros_like(b), 0.0
    residual = 2.0 * s[:, None] * (x @ w + b - y)
    return x.T @ residual / items, residual.sum(axis=0) / items, items


def reference():
    """Windows of STEPS micro-batches, mean = sum n_j g_j / sum n_j (0 when
    the sum is 0), then Keras's SGD with momentum: m = mu m - lr mean,
    theta += m."""
    w, b = W0.astype("float64"), B0.astype("float64")
    mw, mb = np.zeros_like(w), np.zeros_like(b)
    for window in range(len(X) // (MICRO * STEPS)):
        sw, sb, total = np.zeros_like(w), np.zeros_like(b), 0.0
        for j in range(STEPS):
            lo = (window * STEPS + j) * MICRO
            gw, gb, items = mean_gradient(w, b, lo, lo + MICRO)
            sw, sb, total = sw + items * gw, sb + items * gb, total + items
        mean_w, mean_b = (sw / total, sb / total) if total else (0 * sw, 0 * sb)
        mw, mb = MOMENTUM * mw - LR * mean_w, MOMENTUM * mb - LR * mean_b
        w, b = w + mw, b + mb
    return [w, b]


def optimizer():
    return ka.GradientAccumulation(keras.optimizers.SGD(LR, momentum=MOMENTUM), steps=STEPS)


def counts(opt):
    return int(keras.ops.convert_to_numpy(opt.micro_step)), int(
        keras.ops.convert_to_numpy(opt.iterations)
    )


# "traced": JAX's jitted `stateless_apply`; "graph": `apply` in a `tf.function`.
ROUTES = ["number", "tensor"] + {"jax": ["traced"], "tensorflow": ["graph"]}.get(BACKEND, [])


@pytest.mark.parametrize("route", ROUTES)
def test_apply_with_weight_zero_matches_the_numpy_reference(route):
    """A loop of one's own passes each micro-batch's item count, 0 included."""
    variables = [keras.Variable(W0), keras.Variable(B0)]
    opt = optimizer()
    opt.build(variables)
    if route == "traced":
        import jax

        step = jax.jit(
            lambda state, trainable, grads, n: opt.stateless_apply(
                state, grads, trainable, weight=n
            )
        )
        state, trainable = [v.value for v in opt.variables], [v.value for v in variables]
    if route == "graph":
        import tensorflow as tf

        graph_apply = tf.function(lambda grads, n: opt.apply(grads, variables, weight=n))
    for i in range(len(X) // MICRO):
        values = trainable if route == "traced" else variables
        w, b = (keras.ops.convert_to_numpy(v).astype("float64") for v in values)
        gw, gb, items = mean_gradient(w, b, i * MICRO, (i + 1) * MICRO)
        grads = [keras.ops.convert_to_tensor(g.astype("float32")) for g in (gw, gb)]
        if route == "number":
            opt.apply(grads, variables, weight=items)
        elif route == "tensor":
            opt.apply(grads, variables, weight=keras.ops.convert_to_tensor(items, "float32"))
        elif route == "graph":
            graph_apply(grads, tf.constant(items, "float32"))
        else:
            trainable, state = step(state, trainable, grads, np.float32(items))
    if route == "traced":
        for v, value in zip(list(opt.variables) + variables, list(state) + list(trainable)):
            v.assign(value)
    for actual, expected in zip(variables, reference()):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(actual), expected, rtol=1e-5, atol=1e-6
        )
    # Every micro-batch counted, every window stepped (the all-zero one too).
    assert counts(opt) == (6, 3)


def test_fit_under_weigh_micro_batches_matches_the_same_reference():
    """The same micro-batches through `fit`, their counts from the sample
    weights (`weigh_micro_batches`): the same variables as `apply(weight=n)`."""
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    net.set_weights([W0, B0])
    opt = optimizer()
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    net.compile(optimizer=opt, loss=loss)
    ka.weigh_micro_batches(net)
    net.fit(X, Y, sample_weight=SAMPLE_WEIGHTS, batch_size=MICRO, shuffle=False, verbose=0)
    for actual, expected in zip(net.get_weights(), reference()):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert counts(opt) == (6, 3)


def test_the_reference_sees_the_zero_weights():
    """The case can fail: counting each micro-batch as one (no weights)
    gives other variables than the reference."""
    variables = [keras.Variable(W0), keras.Variable(B0)]
    opt = optimizer()
    for i in range(len(X) // MICRO):
        w, b = (keras.ops.convert_to_numpy(v).astype("float64") for v in variables)
        gw, gb, _ = mean_gradient(w, b, i * MICRO, (i + 1) * MICRO)
        opt.apply([keras.ops.convert_to_tensor(g.astype("float32")) for g in (gw, gb)], variables)
    gap = max(
        float(np.max(np.abs(keras.ops.convert_to_numpy(a) - e)))
        for a, e in zip(variables, reference())
    )
    assert gap > 1e-3
