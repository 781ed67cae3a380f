"""A fourth optimizer is one module: a rule written in `keras.ops` alone
(`_fold`, `_update`), with no TensorFlow form, runs on every backend and
under MirroredStrategy.

JAX and PyTorch run every rule this way (`keras_accum.drivers.portable`);
TensorFlow's driver runs the rule's `_fold` on each replica's
replica-local slots and its `_update` at the window's end, in
cross-replica context, where a slot reads as its total over the replicas
(`Driver._tf_fold`, `_tf_update`). Checked against a numpy reference (on
2 logical CPUs too) and against the identity
WindowMeanSGD(lr, steps) == GradientAccumulation(SGD(lr), steps)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_accum as ka
from keras_accum import _compat, base, kernels

TENSORFLOW = keras.backend.backend() == "tensorflow"


class WindowMeanSGD(base.AccumulationOptimizer):
    """theta -= lr * (mean of the window's gradients): the whole optimizer."""

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._sums = [
            self.add_local_variable(v.shape, "float32", "sum", reference=v) for v in var_list
        ]
        self._restore_deferred_state()

    def _sums_of(self, variables):
        return [self._sums[_compat.variable_index(self, v)] for v in variables]

    def _fold(self, grads, variables, weight, start, ok):
        grads = [ops.cast(g, "float32") for g in grads]
        if ok is not True:  # a skipped micro-batch adds zero
            grads = [kernels.masked(ok, g, ops.zeros_like(g)) for g in grads]
        kernels.window_sums(self._sums_of(variables), grads, start)

    def _update(self, variables, keep):
        for var, total in zip(variables, self._sums_of(variables)):
            rate = ops.cast(self.learning_rate, var.dtype) / self.steps
            theta = ops.convert_to_tensor(var)
            var.assign(kernels.masked(keep, theta - rate * ops.cast(total, var.dtype), theta))


RNG = np.random.default_rng(4)
INITS = [RNG.normal(size=3).astype("float32"), RNG.normal(size=(2, 2)).astype("float32")]
GRADS = [[RNG.normal(size=x.shape).astype("float32") for x in INITS] for _ in range(7)]


def test_the_rule_alone_matches_numpy():
    variables = [keras.Variable(x) for x in INITS]
    optimizer = WindowMeanSGD(learning_rate=0.1, steps=3, nonfinite=None)
    expected = [x.copy() for x in INITS]
    for j, grads in enumerate(GRADS):
        optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
        if (j + 1) % 3 == 0:  # a window's end: the mean of its 3 gradients
            for i in range(len(expected)):
                window = [GRADS[k][i] for k in range(j - 2, j + 1)]
                expected[i] = expected[i] - 0.1 * np.mean(window, axis=0)
        for variable, want in zip(variables, expected):
            np.testing.assert_allclose(ops.convert_to_numpy(variable), want, rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations) == 2 and int(optimizer.micro_step) == 7


def test_a_skipped_micro_batch_adds_nothing():
    variables = [keras.Variable(x) for x in INITS]
    optimizer = WindowMeanSGD(learning_rate=0.1, steps=2)  # "skip_micro_batch"
    bad = [np.full_like(g, np.nan) for g in GRADS[0]]
    for grads in (bad, GRADS[1]):
        optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
    for variable, init, g in zip(variables, INITS, GRADS[1]):
        np.testing.assert_allclose(ops.convert_to_numpy(variable), init - 0.1 * g / 2, rtol=1e-6)
    assert int(optimizer.skipped_micro_batches) == 1


def _fit(optimizer, jit_compile):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    x = RNG.normal(size=(48, 4)).astype("float32")
    y = RNG.normal(size=(48, 1)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return [ops.convert_to_numpy(w) for w in model.weights]


@pytest.mark.parametrize("jit_compile", [False, True] if TENSORFLOW else ["auto"])
def test_fit_equals_gradient_accumulation_around_sgd(jit_compile):
    # Equal micro-batches: the window mean of GA is the rule's mean.
    state = RNG.bit_generator.state
    rule = _fit(WindowMeanSGD(learning_rate=0.05, steps=3, nonfinite=None), jit_compile)
    RNG.bit_generator.state = state
    wrapped = ka.GradientAccumulation(keras.optimizers.SGD(0.05), steps=3, nonfinite=None)
    reference = _fit(wrapped, jit_compile)
    for a, b in zip(rule, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not TENSORFLOW, reason="tf.distribute is TensorFlow's")
@pytest.mark.parametrize("nonfinite", [None, "skip_micro_batch"])
def test_the_rule_alone_runs_under_mirrored_strategy(nonfinite):
    # Each replica hands in its share of the micro-batch's mean gradient
    # (Keras's convention): the window's mean is the mean over micro-batches
    # of the sum of the replicas' shares. A NaN on one replica of the third
    # micro-batch leaves that replica's share out, under "skip_micro_batch".
    import conftest
    import tensorflow as tf

    strategy = conftest.mirrored_strategy()
    with strategy.scope():
        variables = [keras.Variable(x) for x in INITS]
        optimizer = WindowMeanSGD(learning_rate=0.1, steps=3, nonfinite=nonfinite)

    @tf.function(autograph=False)
    def step(grads):
        strategy.run(lambda *g: optimizer.apply(list(g), variables), args=tuple(grads))

    shares = [[[g * (r + 1) / 3 for g in grads] for r in range(2)] for grads in GRADS]
    if nonfinite:
        shares[2][1] = [np.full_like(g, np.nan) for g in shares[2][1]]
    expected = [x.astype("float64") for x in INITS]
    for j, call in enumerate(shares):
        per_replica = [
            strategy.experimental_distribute_values_from_function(
                lambda ctx, i=i, call=call: tf.constant(call[ctx.replica_id_in_sync_group][i])
            )
            for i in range(len(INITS))
        ]
        step(per_replica)
        if (j + 1) % 3 == 0:  # theta -= lr * mean over the window of the summed shares
            for i in range(len(expected)):
                window = [
                    sum(shares[k][r][i] for r in range(2) if np.all(np.isfinite(shares[k][r][i])))
                    for k in range(j - 2, j + 1)
                ]
                expected[i] = expected[i] - 0.1 * np.mean(window, axis=0)
    for variable, want in zip(variables, expected):
        np.testing.assert_allclose(ops.convert_to_numpy(variable), want, rtol=1e-5, atol=1e-6)
    count = lambda counter: int(ops.convert_to_numpy(counter))
    assert count(optimizer.iterations) == 2 and count(optimizer.micro_step) == 7
    assert count(optimizer.skipped_micro_batches) == (1 if nonfinite else 0)
