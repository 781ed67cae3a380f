"""What a user sees when a step fails, on every backend: their own error,
never one of ours raised after it, and our refusals in one line.

Keras calls `optimizer.finalize_variable_values` in a `finally` after
`fit`, also when a step failed; under JAX the optimizer's state may then be
unreadable, and 0.3.0's end-of-fit window check raised `TypeError:
'NoneType' object is not callable` over the user's error.
`nonfinite.explained()` named TensorFlow's error class in an `except`, a
`TypeError` of its own under JAX and PyTorch.
"""

import re

import keras
import numpy as np
import pytest

import keras_accum as ka
from keras_accum import nonfinite

BACKEND = keras.backend.backend()

MAKERS = {
    "adam": lambda **kw: keras.optimizers.Adam(1e-3),
    "ga": lambda **kw: ka.GradientAccumulation(keras.optimizers.Adam(1e-3), 4, **kw),
    "ua": lambda **kw: ka.UpdateAccumulationAdam(1e-3, steps=4, **kw),
    "ia": lambda **kw: ka.InvariantAdam(1e-3, steps=4, **kw),
}


class Boom(keras.layers.Layer):
    """A bug in the user's model: its training call raises."""

    def call(self, x, training=None):
        if training:
            raise ValueError("user bug: boom")
        return x


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")


def model(*extra):
    return keras.Sequential([keras.Input((4,)), *extra, keras.layers.Dense(1)])


def failure(call):
    """(type name, message) of what `call` raises."""
    with pytest.raises(Exception) as caught:
        call()
    return type(caught.value).__name__, str(caught.value)


@pytest.mark.parametrize("name", ["ga", "ua", "ia"])
def test_a_failing_model_shows_the_users_error_as_plain_adam_does(name):
    x, y = data()

    def fit(make):
        net = model(Boom())
        net.compile(optimizer=make(), loss="mse")
        net.fit(x, y, batch_size=8, verbose=0)

    expected = failure(lambda: fit(MAKERS["adam"]))
    assert expected[0] == "ValueError" and "user bug: boom" in expected[1]
    assert failure(lambda: fit(MAKERS[name])) == expected


# (case, backend) -> what the user sees: the error's type and a regex of its one line.
RAISE_POLICY = {
    "tensorflow": ("NonFiniteGradientError", r"^{opt}: non-finite gradient .* at micro-step 2$"),
    "torch": ("NonFiniteGradientError", r"^{opt}: non-finite gradient .* at micro-step 2$"),
    "jax": ("ValueError", r"nonfinite='raise' cannot stop a compiled JAX step.*Received"),
}


@pytest.mark.parametrize("name", ["ga", "ua", "ia"])
def test_raise_policy_under_explained_says_one_line(name):
    x, y = data()
    y[9] = np.nan  # the second micro-batch of 8
    optimizer = MAKERS[name](nonfinite="raise")
    net = model()
    net.compile(optimizer=optimizer, loss="mse")

    def fit():
        with nonfinite.explained():
            net.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    kind, message = failure(fit)
    expected_kind, pattern = RAISE_POLICY[BACKEND]
    assert kind == expected_kind, message
    assert "\n" not in message
    assert re.search(pattern.format(opt=optimizer.name), message), message


@pytest.mark.parametrize(
    "error", [ValueError("mine"), KeyError("mine"), RuntimeError("x: non-finite")]
)
def test_explained_passes_other_errors_through_unchanged(error):
    with pytest.raises(type(error)) as caught:
        with nonfinite.explained():
            raise error
    assert caught.value is error


def test_import_chooses_no_backend(tmp_path):
    """`import keras_accum` leaves the backend to KERAS_BACKEND and
    keras.json, as Keras does (0.3.0 set TensorFlow when the variable was
    unset, over a keras.json that said otherwise). keras.json says JAX:
    where JAX is installed the child runs on it without importing
    TensorFlow; where it is not (the README's `[test]` install, TensorFlow
    only) Keras's import fails on JAX, which it would not try had
    keras_accum chosen TensorFlow. (Keras's numpy backend imports JAX too.)"""
    import importlib.util
    import json
    import os
    import pathlib
    import subprocess
    import sys

    (tmp_path / "keras.json").write_text(json.dumps({"backend": "jax"}))
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = str(pathlib.Path(ka.__file__).parents[1])
    code = (
        "import keras_accum, keras, sys; "
        "print(keras.backend.backend(), 'tensorflow' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    if importlib.util.find_spec("jax") is not None:
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["jax", "False"]
    else:
        assert out.returncode != 0, out.stdout
        assert "No module named 'jax'" in out.stderr, out.stderr[-2000:]


# -- the library's bad-input table (the scripts' is tests/test_bad_input.py) --
# (case, call, the argument named, the value echoed): each is refused in ONE
# line that names the argument and echoes what was received, on every backend.


def fit_with_another_batch_size():
    steps = ka.PiecewiseSteps([32], [1, 4], unit="examples", micro_batch_size=4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=ka.InvariantAdam(steps=steps), loss="mse")
    model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=8, verbose=0)


BAD_INPUT = [
    ("steps 0", lambda: ka.InvariantAdam(steps=0), "`steps`", "steps=0"),
    ("steps str", lambda: ka.UpdateAccumulationAdam(steps="4"), "`steps`", "steps='4'"),
    ("steps float", lambda: ka.GradientAccumulation(keras.optimizers.SGD(), 2.5), "`steps`", "2.5"),
    ("nonfinite", lambda: ka.InvariantAdam(nonfinite="skip"), "`nonfinite`", "'skip'"),
    (
        "skip_window on IA",
        lambda: ka.InvariantAdam(nonfinite="skip_window"),
        "skip_window",
        "nonfinite='skip_window'",
    ),
    ("learning_rate", lambda: ka.InvariantAdam(-1e-3), "`learning_rate`", "-0.001"),
    ("beta_1", lambda: ka.UpdateAccumulationAdam(beta_1=1.5), "`beta_1`", "beta_1=1.5"),
    ("beta_2", lambda: ka.InvariantAdam(beta_2=-0.1), "`beta_2`", "beta_2=-0.1"),
    ("epsilon", lambda: ka.InvariantAdam(epsilon=-1.0), "`epsilon`", "epsilon=-1.0"),
    ("weight_decay", lambda: ka.InvariantAdam(weight_decay=-0.1), "`weight_decay`", "-0.1"),
    ("scaling_rule", lambda: ka.InvariantAdam(scaling_rule="cubic"), "`scaling_rule`", "cubic"),
    (
        "keras accumulation",
        lambda: ka.InvariantAdam(gradient_accumulation_steps=2),
        "`gradient_accumulation_steps`",
        "gradient_accumulation_steps=2",
    ),
    ("inner not an optimizer", lambda: ka.GradientAccumulation("adam", 2), "`optimizer`", "adam"),
    (
        "nested",
        lambda: ka.GradientAccumulation(ka.InvariantAdam(), 2),
        "`optimizer`",
        "Received: optimizer=",
    ),
    (
        "inner with Keras's accumulation",
        lambda: ka.GradientAccumulation(keras.optimizers.Adam(gradient_accumulation_steps=2), 2),
        "gradient_accumulation_steps",
        "2",
    ),
    (
        "PiecewiseSteps not increasing",
        lambda: ka.PiecewiseSteps([8, 4], [1, 2, 4]),
        "`boundaries`",
        "[8, 4]",
    ),
    (
        "PiecewiseSteps lengths",
        lambda: ka.PiecewiseSteps([4], [1, 2, 4]),
        "`values`",
        "[1, 2, 4]",
    ),
    (
        "rematerialize mode",
        lambda: ka.rematerialize(
            keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "ful"
        ),
        "`mode`",
        "mode='ful'",
    ),
    (
        "PiecewiseSteps in examples, fit with another batch_size",
        lambda: fit_with_another_batch_size(),
        "`micro_batch_size`",
        "micro_batch_size=4, batch_size=8",
    ),
    (
        "scale_hyperparameters kappa",
        lambda: ka.scale_hyperparameters(0, "linear", 1e-3),
        "`kappa`",
        "kappa=0",
    ),
]


@pytest.mark.parametrize(
    "call, argument, echoed", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_is_refused_in_one_line_naming_the_argument(call, argument, echoed):
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    assert argument in message, message
    assert echoed in message, message


# 0 is a weight (a micro-batch whose items all weigh zero: test_weight_zero.py).
BAD_WEIGHTS = [
    -2.0,
    -1,
    np.float32(-0.5),
    float("nan"),
    float("inf"),
    True,
    np.ones(2, "float32"),
    np.array([1.0]),
    "3",
    keras.ops.convert_to_tensor(-1.0),
    keras.ops.convert_to_tensor(float("nan")),
    keras.ops.convert_to_tensor([1.0, 2.0]),
]


@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=[repr(w).splitlines()[0] for w in BAD_WEIGHTS])
def test_bad_weight_is_refused_and_changes_nothing(weight):
    """A bad `weight` is refused before anything is written: the variables,
    the counters and the window stay as they were."""
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2)
    optimizer.apply([keras.ops.ones((2,))], [variable], weight=3.0)  # half a window
    before = [keras.ops.convert_to_numpy(v).copy() for v in optimizer.variables + [variable]]
    with pytest.raises(ValueError, match=r"`weight` must be .*Received: weight=") as caught:
        optimizer.apply([keras.ops.ones((2,))], [variable], weight=weight)
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith(f"Received: weight={weight!r}"), caught.value
    after = [keras.ops.convert_to_numpy(v) for v in optimizer.variables + [variable]]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
