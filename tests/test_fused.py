"""The graph-mode folds (one compiled kernel per micro-batch, keras_accum/
_execution.run) under model.fit and MirroredStrategy, against the numpy
references; with 2 replicas every replica's copy of the state must agree.
"""

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka
from keras_accum.drivers.tensorflow import _execution

RNG = np.random.default_rng(3)
X = RNG.normal(size=(32, 3)).astype("float32")
Y = RNG.normal(size=(32, 2)).astype("float32")
X[8, 1] = np.nan  # micro-batch 2 (b = 4): a window's first one, skipped

OPTIMIZERS = {
    "invariant_adam": (
        lambda: ka.InvariantAdam(0.05, beta_1=0.8, beta_2=0.95, steps=2),
        lambda: references.InvariantAdam(0.05, 2, b1=0.8, b2=0.95),
    ),
    "update_accumulation_adam": (
        lambda: ka.UpdateAccumulationAdam(0.05, beta_1=0.8, beta_2=0.95, steps=2),
        lambda: references.UpdateAccumulationAdam(0.05, 2, b1=0.8, b2=0.95),
    ),
}


def _mse_gradients(params, x, y):
    """Gradients of Keras's "mse" (mean over outputs and batch) of x W + c."""
    kernel, bias = params
    residual = x @ kernel + bias - y
    scale = 2.0 / residual.size
    return [scale * x.T @ residual, scale * residual.sum(0)]


@pytest.fixture(autouse=True)
def compiled_fold(monkeypatch):
    """These models are tiny: compile their folds anyway (the default
    leaves a fold this small to TensorFlow ops, see `_execution.MIN_PARAMETERS`)."""
    monkeypatch.setattr(_execution, "MIN_PARAMETERS", 0)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("steps_per_execution", [1, 4])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_matches_numpy_reference(name, steps_per_execution, compiled, monkeypatch):
    if not compiled:  # the small-model path: the same fold as TensorFlow ops
        monkeypatch.setattr(_execution, "MIN_PARAMETERS", 10**9)
    make, make_reference = OPTIMIZERS[name]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=make(), loss="mse", steps_per_execution=steps_per_execution)
    params = [w.astype("float64") for w in model.get_weights()]
    model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    reference = make_reference()
    for _ in range(2):
        for start in range(0, len(X), 4):
            x, y = X[start : start + 4].astype("float64"), Y[start : start + 4]
            params = reference.apply(params, _mse_gradients(params, x, y))
    assert int(model.optimizer.iterations) == 8
    assert int(model.optimizer.skipped_micro_batches) == 2
    for ours, theirs in zip(model.get_weights(), params):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def _replica_values(strategy, variables):
    local = strategy.experimental_local_results
    return [[v.numpy() for v in local(var.value)] for var in variables]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mirrored_graph_fold_matches_reference(name):
    # Calls x replicas; replica 1's gradient of call 2 (a window's first) is
    # non-finite. InvariantAdam sees kappa = 4 micro-batches per window;
    # UpdateAccumulationAdam one replica-mean gradient per micro-step.
    strategy = mirrored_strategy()
    rng = np.random.default_rng(4)
    values = rng.normal(size=(6, 2, 3)).astype("float32")
    values[2, 1, 0] = np.inf
    with strategy.scope():
        var = keras.Variable(np.zeros(3, "float32"))
        opt = ka.InvariantAdam(0.1, steps=2) if name == "invariant_adam" else None
        opt = opt or ka.UpdateAccumulationAdam(0.1, steps=2)
        opt.build([var])

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply([g], [var]), args=(grads,))

    theta = [np.zeros(3)]
    if name == "invariant_adam":
        reference = references.InvariantAdam(0.1, 4)
        for call in values:
            for g in call:
                theta = reference.apply(theta, [g.astype("float64")])
    else:
        reference = references.UpdateAccumulationAdam(0.1, 2)
        for call in values:
            # A non-finite share makes the replica-mean non-finite: skipped.
            theta = reference.apply(theta, [call.astype("float64").mean(0)])
    for call in values:
        # Keras convention: each replica hands in its share g_r / replicas.
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx, call=call: tf.constant(call[ctx.replica_id_in_sync_group] / 2)
        )
        step(per_replica)
    np.testing.assert_allclose(var.numpy(), theta[0], rtol=1e-5, atol=1e-6)
    for copies in _replica_values(strategy, [var] + opt.variables):
        assert all(np.all(np.isfinite(c)) for c in copies)
    if name == "update_accumulation_adam":
        # Mirrored state: every replica's copy is the same.
        for copies in _replica_values(strategy, [var] + opt.variables):
            np.testing.assert_array_equal(copies[0], copies[1])
