"""The last, partial window (issue #51): `flush_last_window=True` applies
it where `fit` ends, `flush()` in a loop of one's own, as a window of its
own: `GradientAccumulation` with the weighted mean of what it holds (the
big batch of those micro-batches), `UpdateAccumulationAdam` with the steps
its buffer holds; `InvariantAdam` refuses. The default keeps the window
for later, with a warning (tests/conftest.py's `ends_mid_window`).

Backend-free: `.ci/backends` runs it under JAX and PyTorch too.
"""

import warnings

import keras
import numpy as np
import pytest
import references as ref
from conftest import ends_mid_window

import keras_accum as ka

RNG = np.random.default_rng(0)
X = RNG.normal(size=(80, 5)).astype("float32")
Y = RNG.normal(size=(80, 1)).astype("float32")


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def test_fit_ends_on_the_big_batch_of_the_last_micro_batches():
    # 10 micro-batches of 8, windows of 4: 4 + 4 + 2. Flushed, the last 2
    # are a window of 16 examples: Keras's Adam at batches of 32, 32, 16.
    ours = _model(
        ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4, flush_last_window=True)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inside a window")  # flushed: no warning
        ours.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    big = _model(keras.optimizers.Adam(0.01))
    big.fit(X, Y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(ours), _weights(big)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(keras.ops.convert_to_numpy(ours.optimizer.iterations)) == 3
    assert ours.optimizer.pending_micro_batches() == 0
    # Training goes on: the next micro-batches finish the window by count
    # (2 more), applied as a window of their own.
    ours.fit(X[:16], Y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    big.fit(X[:16], Y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(ours), _weights(big)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(keras.ops.convert_to_numpy(ours.optimizer.iterations)) == 4


@ends_mid_window
def test_the_default_keeps_the_window_and_warns():
    ours = _model(ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4))
    with pytest.warns(UserWarning, match="flush_last_window=True"):
        ours.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(ours.optimizer.iterations)) == 2
    assert ours.optimizer.pending_micro_batches() == 2


def _params():
    rng = np.random.default_rng(1)
    return [keras.Variable(rng.normal(size=s).astype("float32")) for s in ((3, 2), (2,))]


def _grads(count):
    rng = np.random.default_rng(2)
    return [[rng.normal(size=s).astype("float32") for s in ((3, 2), (2,))] for _ in range(count)]


def test_flush_weighs_the_micro_batches_it_holds():
    # Weights 3 and 1 in a window of 4, flushed after 2: S / W of those two.
    params = _params()
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.5), steps=4)
    expected = [p.numpy().astype("float64") for p in params]
    grads = _grads(2)
    for g, w in zip(grads, (3.0, 1.0)):
        optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], params, weight=w)
    assert optimizer.flush() is True
    mean = [(3.0 * a + 1.0 * b) / 4.0 for a, b in zip(*grads)]
    expected = [p - 0.5 * m for p, m in zip(expected, mean)]
    for p, e in zip(params, expected):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(p), e, rtol=1e-6, atol=1e-6)
    assert optimizer.flush() is False  # nothing held: nothing applied
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 1


def test_update_accumulation_adam_flush_applies_its_buffer():
    params = _params()
    optimizer = ka.UpdateAccumulationAdam(0.01, steps=4)
    reference = ref.UpdateAccumulationAdam(0.01, 4)
    expected = [p.numpy().astype("float64") for p in params]
    for g in _grads(6):  # a window of 4, then 2 flushed
        optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], params)
        expected = reference.apply(expected, [x.astype("float64") for x in g])
    assert optimizer.flush() is True
    expected = [p - a for p, a in zip(expected, reference.update)]
    for p, e in zip(params, expected):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(p), e, rtol=1e-5, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2
    state = [keras.ops.convert_to_numpy(a) for a in optimizer._updates]
    assert all(np.all(a == 0) for a in state)  # the buffer starts afresh


def test_a_dropped_window_is_dropped_by_flush_too():
    params = _params()
    before = [p.numpy() for p in params]
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.5), steps=4)  # skip_window
    bad = _grads(2)
    bad[1][0][0, 0] = np.nan
    for g in bad:
        optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], params)
    assert optimizer.flush() is True
    for p, b in zip(params, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(p), b)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_updates)) == 1
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0


def test_invariant_adam_refuses_in_one_line():
    with pytest.raises(ValueError, match=r"window's size.*Received: flush_last_window=True$"):
        ka.InvariantAdam(0.01, steps=4, flush_last_window=True)
    with pytest.raises(ValueError, match=r"Received: a call of flush\(\)$"):
        ka.InvariantAdam(0.01, steps=4).flush()


def test_a_bad_flush_last_window_is_named():
    with pytest.raises(ValueError, match=r"Received: flush_last_window='yes'$"):
        ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2, flush_last_window="yes")


def test_the_config_keeps_it():
    optimizer = ka.UpdateAccumulationAdam(0.01, steps=3, flush_last_window=True)
    assert ka.UpdateAccumulationAdam.from_config(optimizer.get_config()).flush_last_window
    ga = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2, flush_last_window=True)
    assert ka.GradientAccumulation.from_config(ga.get_config()).flush_last_window


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.distribute")
@pytest.mark.parametrize("make", ["ga", "uaa"])
def test_flush_under_mirrored_strategy_is_one_device(make):
    # 2 replicas x micro-batches of 4 (global 8), windows of 4: 4 + 4 + 2;
    # the flushed 2 against one device running the same global micro-batches.
    from conftest import mirrored_strategy

    def optimizer():
        if make == "ga":
            return ka.GradientAccumulation(
                keras.optimizers.Adam(0.01), steps=4, flush_last_window=True
            )
        return ka.UpdateAccumulationAdam(0.01, steps=4, flush_last_window=True)

    with mirrored_strategy().scope():
        ours = _model(optimizer())
    ours.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    one = _model(optimizer())
    one.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(ours), _weights(one)):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert int(keras.ops.convert_to_numpy(ours.optimizer.iterations)) == 3
    assert ours.optimizer.pending_micro_batches() == 0
