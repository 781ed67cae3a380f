"""Bad input names the argument and echoes the value; the scaling table."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka

OPTIMIZERS = {
    "gradient_accumulation": lambda **kw: ka.GradientAccumulation(keras.optimizers.SGD(0.1), **kw),
    "invariant_adam": lambda **kw: ka.InvariantAdam(**kw),
    "update_accumulation_adam": lambda **kw: ka.UpdateAccumulationAdam(**kw),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("steps", [0, -3, 2.0, 1.5, "4", True, None])
def test_bad_steps(name, steps):
    with pytest.raises(
        ValueError,
        match=r"`steps` must be an integer >= 1\. "
        rf"Received: steps={repr(steps)}",
    ):
        OPTIMIZERS[name](steps=steps)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bad_nonfinite(name):
    with pytest.raises(ValueError, match="Received: nonfinite='ignore'"):
        OPTIMIZERS[name](nonfinite="ignore")


@pytest.mark.parametrize("inner", [None, "adam", keras.losses.MeanSquaredError()])
def test_inner_must_be_a_keras_optimizer(inner):
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be a "
        r"`keras.optimizers.Optimizer` instance. Received",
    ):
        ka.GradientAccumulation(inner, steps=2)


def test_no_nested_or_double_accumulation():
    with pytest.raises(ValueError, match="nest windows"):
        ka.GradientAccumulation(ka.InvariantAdam(), steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        ka.GradientAccumulation(keras.optimizers.Adam(gradient_accumulation_steps=2), steps=2)


@pytest.mark.parametrize("name", ["invariant_adam", "update_accumulation_adam"])
def test_adam_variants_refuse_keras_accumulation(name):
    # They accumulate themselves; clipping, EMA and the rest are supported
    # (tests/test_ported.py).
    argument = "gradient_accumulation_steps"
    with pytest.raises(ValueError, match=f"does not support `{argument}`"):
        OPTIMIZERS[name](**{argument: 2})


def test_invariant_adam_refuses_skip_window():
    with pytest.raises(ValueError, match="nonfinite='skip_window'"):
        ka.InvariantAdam(nonfinite="skip_window")


def test_apply_in_cross_replica_context_is_an_error():
    strategy = mirrored_strategy()
    with strategy.scope():
        var = keras.Variable(np.zeros(2, "float32"))
        opt = ka.InvariantAdam(steps=2)
        opt.build([var])
        with pytest.raises(ValueError, match="replica context"):
            opt.apply([tf.zeros(2)], [var])


# -- scale_hyperparameters ----------------------------------------------------

BASE = dict(learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7)


@pytest.mark.parametrize("kappa", [1, 2, 4, 8])
def test_rule_table(kappa):
    inv = ka.scale_hyperparameters(kappa=kappa, rule="invariant", **BASE)
    assert inv["learning_rate"] == pytest.approx(kappa * 1e-3)
    assert 1 - inv["beta_1"] == pytest.approx(kappa * 0.1)
    assert 1 - inv["beta_2"] == pytest.approx(kappa * 0.001)
    assert inv["epsilon"] == 1e-7
    sqrt = ka.scale_hyperparameters(kappa=kappa, rule="sqrt", **BASE)
    assert sqrt["learning_rate"] == pytest.approx(math.sqrt(kappa) * 1e-3)
    assert 1 - sqrt["beta_2"] == pytest.approx(kappa * 0.001)
    assert sqrt["epsilon"] == pytest.approx(1e-7 / math.sqrt(kappa))
    power = ka.scale_hyperparameters(kappa=kappa, rule="power", **BASE)
    assert power["beta_1"] == pytest.approx(0.9**kappa)
    assert power["beta_2"] == pytest.approx(0.999**kappa)
    assert power["learning_rate"] == pytest.approx(kappa * 1e-3)


def test_kappa_1_changes_nothing():
    for rule in ("invariant", "sqrt", "power"):
        assert ka.scale_hyperparameters(kappa=1, rule=rule, **BASE) == pytest.approx(BASE)


@pytest.mark.parametrize("rule", ["invariant", "sqrt"])
def test_linear_beta_rule_refused_when_meaningless(rule):
    with pytest.raises(
        ValueError,
        match=r"kappa \* \(1 - beta_1\) = 1 >= 1.*"
        r"rule='power'.*Received: kappa=10, beta_1=0.9",
    ):
        ka.scale_hyperparameters(kappa=10, rule=rule, **BASE)
    # The exponent variant is defined there.
    assert ka.scale_hyperparameters(kappa=10, rule="power", **BASE)["beta_1"] == pytest.approx(
        0.9**10
    )


def test_unknown_rule_and_bad_kappa():
    with pytest.raises(ValueError, match="Received: rule='linear'"):
        ka.scale_hyperparameters(kappa=2, rule="linear", **BASE)
    for kappa in (0, -1, True, "2", float("inf")):
        with pytest.raises(ValueError, match=f"Received: kappa={kappa!r}"):
            ka.scale_hyperparameters(kappa=kappa, rule="invariant", **BASE)
