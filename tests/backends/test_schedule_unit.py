"""A schedule in examples or tokens checks its unit against what `fit`
trains (issue #51). `PiecewiseSteps(unit="examples", micro_batch_size=B)`
places a boundary of b examples at micro-step ceil(b / B); a `fit` whose
`batch_size` is not B would switch elsewhere than written (in the probe
below, 9 updates where the schedule means 6), so it is refused in one line
naming both sizes, before anything is written, and the model trains
afterwards with the right size. Outside `fit` (a loop of one's own, which
chose both sizes) nothing is checked."""

import warnings

import keras
import numpy as np
import pytest

import keras_accum as ka

X = np.random.default_rng(0).normal(size=(96, 4)).astype("float32")
Y = np.zeros((96, 1), "float32")


def compiled(steps):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = ka.InvariantAdam(1e-2, steps=steps, scaling_rule="invariant")
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def examples_schedule(micro_batch_size):
    # 1 micro-batch per update until 32 examples, then 4.
    return ka.PiecewiseSteps([32], [1, 4], unit="examples", micro_batch_size=micro_batch_size)


def snapshot(model, optimizer):
    values = model.get_weights()
    if optimizer.built:
        values += [keras.ops.convert_to_numpy(v) for v in optimizer.variables]
    return values


def assert_same(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_the_switch_lands_where_written():
    """96 examples in batches of 8 with the boundary at 32 examples: 4
    windows of 1, then 8 micro-batches in windows of 4, 6 updates (a
    schedule told 4 would switch at 64 examples: 9)."""
    model, optimizer = compiled(examples_schedule(8))
    model.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 6


@pytest.mark.parametrize("trained_first", [False, True], ids=["first_fit", "later_fit"])
def test_another_batch_size_is_refused_in_one_line_and_writes_nothing(trained_first):
    model, optimizer = compiled(examples_schedule(4))
    if trained_first:
        model.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError) as caught:
        model.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith("`micro_batch_size`"), message
    assert message.endswith("Received: micro_batch_size=4, batch_size=8"), message
    # Nothing written, and the model still trains (on JAX, `fit` holds the
    # variables in its state during a step; on TensorFlow its first trace
    # failed): with the size the schedule was given, where it says.
    assert_same(before, snapshot(model, optimizer))
    model.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    updates = int(keras.ops.convert_to_numpy(optimizer.iterations))
    assert updates == (18 if trained_first else 12)  # 8 + 16 / 4, then 24 / 4 more


@pytest.mark.parametrize(
    "tokens, batch_size, refused", [(64, 8, False), (100, 8, True), (64, 16, False)]
)
def test_tokens_per_micro_batch_must_be_whole_tokens_per_example(tokens, batch_size, refused):
    steps = ka.PiecewiseSteps([640], [1, 2], unit="tokens", tokens_per_micro_batch=tokens)
    model, _ = compiled(steps)
    if not refused:
        model.fit(X, Y, batch_size=batch_size, verbose=0)
        return
    with pytest.raises(ValueError) as caught:
        model.fit(X, Y, batch_size=batch_size, verbose=0)
    assert str(caught.value).endswith(
        f"Received: tokens_per_micro_batch={tokens}, batch_size={batch_size}"
    )


def test_an_adaptive_warmup_in_examples_is_checked_too():
    warmup = examples_schedule(4)
    steps = ka.AdaptiveSteps(1, 8, micro_batch_size=4, warmup=warmup)
    model, _ = compiled(steps)
    with pytest.raises(ValueError, match=r"Received: micro_batch_size=4, batch_size=16$"):
        model.fit(X, Y, batch_size=16, verbose=0)


def test_a_batch_size_fit_cannot_tell_is_named_in_a_warning():
    """A generator's batches say nothing of their size before they come."""

    def batches():
        while True:
            yield X[:4], Y[:4]

    model, optimizer = compiled(examples_schedule(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(batches(), steps_per_epoch=24, verbose=0)
    ours = [w for w in caught if "PiecewiseSteps" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "micro_batch_size=4" in str(ours[0].message)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 12


def test_a_loop_of_ones_own_is_not_checked():
    """Outside `fit` the loop chose both sizes: `apply` says nothing."""
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer = ka.InvariantAdam(1e-2, steps=examples_schedule(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(12):
            optimizer.apply([keras.ops.ones((2,))], [variable])
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 9  # 8 of 1, then 1 of 4
