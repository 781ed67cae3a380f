"""A model kept in bfloat16 (issue #51): the Adam variants keep their
moments in float32 (`state_dtype`), so a window moves the weights as
float32 state does, written in bfloat16; `state_dtype=None` is Keras's Adam
(moments in bfloat16, where beta_2 = 0.999 rounds to 1 and the step to 0).
`GradientAccumulation` sums in float32 and says when its inner Keras
optimizer keeps bfloat16 slots. Counters are integers, exact past 2**16.

Backend-free: `.ci/backends` runs it under JAX and PyTorch too.
"""

import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
import references as ref

import keras_accum as ka

BF16 = ml_dtypes.bfloat16
SHAPES = ((3, 2), (2,))


def bf16(x):
    """x rounded to bfloat16, as float64."""
    return np.asarray(x, "float32").astype(BF16).astype("float64")


def ulps(actual, expected):
    """|actual - expected| in bfloat16 spacings at expected's magnitude."""
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(expected), 1e-30))) - 7)
    return np.abs(actual - expected) / spacing


def run(optimizer, reference, count, windows_of):
    """`count` micro-batches of bfloat16 gradients into bfloat16 variables;
    the reference runs in float64 and rounds theta to bfloat16 at each of
    its writes (once per window, every `windows_of` micro-batches)."""
    rng = np.random.default_rng(0)
    start = [bf16(rng.normal(size=s)) for s in SHAPES]
    params = [keras.Variable(p.astype("float32"), dtype="bfloat16") for p in start]
    expected = [p.copy() for p in start]
    for i in range(count):
        grads = [bf16(rng.normal(size=s)) for s in SHAPES]
        optimizer.apply([keras.ops.cast(g, "bfloat16") for g in grads], params)
        expected = reference.apply(expected, grads)
        if (i + 1) % windows_of == 0:
            expected = [bf16(p) for p in expected]
    actual = [keras.ops.convert_to_numpy(keras.ops.cast(p, "float32")) for p in params]
    return [a.astype("float64") for a in actual], expected, start


CASES = {
    "ia_1": (
        lambda **k: ka.InvariantAdam(0.01, steps=1, **k),
        lambda: ref.InvariantAdam(0.01, 1),
        1,
    ),
    "ia_4": (
        lambda **k: ka.InvariantAdam(0.01, steps=4, **k),
        lambda: ref.InvariantAdam(0.01, 4),
        4,
    ),
    "ua_1": (
        lambda **k: ka.UpdateAccumulationAdam(0.01, steps=1, **k),
        lambda: ref.UpdateAccumulationAdam(0.01, 1),
        1,
    ),
    "ua_4": (
        lambda **k: ka.UpdateAccumulationAdam(0.01, steps=4, **k),
        lambda: ref.UpdateAccumulationAdam(0.01, 4),
        4,
    ),
    # Float32 sums; the mean stepped by Keras's SGD, which keeps no slot.
    "ga_sgd_4": (
        lambda: ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=4),
        lambda: ref.GradientAccumulation(ref.SGD(0.1), 4),
        4,
    ),
}


def _state(optimizer):
    """The optimizer's window state and moments."""
    if isinstance(optimizer, ka.GradientAccumulation):
        return optimizer._accumulators + [optimizer._weight]
    return optimizer._momentums + optimizer._velocities


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_state_of_a_bfloat16_model_is_the_reference_rounded(name):
    make, reference, windows_of = CASES[name]
    optimizer = make()
    actual, expected, start = run(optimizer, reference(), 16, windows_of)
    assert {str(v.dtype) for v in _state(optimizer)} == {"float32"}
    for a, e, s in zip(actual, expected, start):
        # Each write rounds once to bfloat16, as the reference's; float32
        # against float64 arithmetic may land a value on the other side of
        # a rounding boundary: one spacing at most.
        assert np.max(ulps(a, e)) <= 1.0, (a, e)
        assert np.mean(a == e) >= 0.75, (a, e)
        assert np.max(np.abs(a - s)) > 0.01  # the weights moved


def test_bfloat16_state_is_keras_adam_and_stalls():
    # `state_dtype=None`: the moments in bfloat16, as Keras's Adam keeps
    # them; beta_2 = 0.999 rounds to 1, alpha to 0: nothing moves (the
    # outside trial's result), where float32 state moves every weight.
    stalled = ka.InvariantAdam(0.01, steps=4, state_dtype=None)
    actual, expected, start = run(stalled, ref.InvariantAdam(0.01, 4), 8, 4)
    assert {str(v.dtype) for v in stalled._momentums} == {"bfloat16"}
    for a, s in zip(actual, start):
        np.testing.assert_array_equal(a, s)
    keras_adam = ka.UpdateAccumulationAdam(0.01, steps=1, state_dtype=None)
    theirs = keras.optimizers.Adam(0.01)
    ours_params = [keras.Variable(np.ones(3, "float32"), dtype="bfloat16") for _ in range(2)]
    for _ in range(3):
        g = keras.ops.cast(keras.ops.convert_to_tensor([0.5, -1.0, 2.0]), "bfloat16")
        keras_adam.apply([g], ours_params[:1])
        theirs.apply([g], ours_params[1:])
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(ours_params[0], "float32")),
        keras.ops.convert_to_numpy(keras.ops.cast(ours_params[1], "float32")),
    )


def test_float32_variables_keep_their_own_state_dtype():
    optimizer = ka.InvariantAdam(0.01, steps=2)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    assert str(optimizer._momentums[0].dtype) == "float32"
    assert optimizer.get_config()["state_dtype"] == "float32"
    restored = ka.InvariantAdam.from_config({**optimizer.get_config(), "state_dtype": None})
    assert restored.state_dtype is None


def test_a_bad_state_dtype_is_named():
    with pytest.raises(ValueError, match=r"`state_dtype` must be one of .*state_dtype='float16'"):
        ka.UpdateAccumulationAdam(0.01, state_dtype="float16")


def test_gradient_accumulation_names_its_inner_bfloat16_slots():
    var = keras.Variable(np.zeros(2, "float32"), dtype="bfloat16")
    optimizer = ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2)
    with pytest.warns(UserWarning, match="keeps its slots in bfloat16.*mixed_bfloat16"):
        optimizer.build([var])
    assert {str(a.dtype) for a in optimizer._accumulators} == {"float32"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 variables: no warning
        ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=2).build(
            [keras.Variable(np.zeros(2, "float32"))]
        )


def test_counters_are_exact_past_2_to_the_16():
    # A bfloat16 counter stops at 256 (pytorch/ao #4915): these are integers.
    var = keras.Variable(np.zeros(2, "float32"), dtype="bfloat16")
    optimizer = ka.UpdateAccumulationAdam(0.01, steps=4)
    optimizer.build([var])
    start = 2**16 + 4
    optimizer.micro_step.assign(start)
    optimizer._moment_steps.assign(start)
    optimizer.iterations.assign(start // 4)
    for _ in range(8):
        optimizer.apply([keras.ops.ones(2, "bfloat16")], [var])
    assert int(keras.ops.convert_to_numpy(optimizer.micro_step)) == start + 8
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == start // 4 + 2
    assert int(keras.ops.convert_to_numpy(optimizer._moment_steps)) == start + 8


@pytest.mark.parametrize("variant", [ka.InvariantAdam, ka.UpdateAccumulationAdam])
def test_fit_under_the_bfloat16_policy_moves_the_weights(variant):
    # The outside trial: a model under `set_dtype_policy("bfloat16")`, one
    # window of 4 micro-batches. Float32 moments move every weight; with
    # InvariantAdam's moments in bfloat16 (Keras's Adam's way) nothing moves.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    moved = {}
    keras.config.set_dtype_policy("bfloat16")
    try:
        for state_dtype in ("float32", None):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer=variant(2e-2, steps=4, state_dtype=state_dtype), loss="mse")
            before = [np.asarray(w, "float32") for w in model.get_weights()]
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            after = [np.asarray(w, "float32") for w in model.get_weights()]
            assert {str(v.dtype) for v in model.trainable_variables} == {"bfloat16"}
            assert {str(m.dtype) for m in model.optimizer._momentums} == {state_dtype or "bfloat16"}
            moved[state_dtype] = [float(np.min(np.abs(a - b))) for a, b in zip(after, before)]
    finally:
        keras.config.set_dtype_policy("float32")
    assert min(moved["float32"]) > 0  # every weight moved
    if variant is ka.InvariantAdam:
        assert max(moved[None]) == 0.0
