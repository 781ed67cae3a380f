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


@pytest.mark.parametrize(
    "name, outside",
    [(name, "optimizer") for name in sorted(OPTIMIZERS)] + [("gradient_accumulation", "inner")],
)
def test_optimizer_created_outside_the_scope_is_named_under_fit(name, outside):
    # Keras builds the optimizer before its first `apply`: the check must
    # fire in `build`, else TensorFlow's "Mixing different tf.distribute.
    # Strategy objects" comes first.
    strategy = mirrored_strategy()
    if outside == "inner":
        inner = keras.optimizers.SGD(0.1)
        with strategy.scope():
            optimizer = ka.GradientAccumulation(inner, steps=2)
    else:
        optimizer = OPTIMIZERS[name](steps=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=r"was created under another tf.distribute strategy"):
        model.fit(x, y, batch_size=4, verbose=0)


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
    fixed = ka.scale_hyperparameters(kappa=kappa, rule="fixed_beta_1", **BASE)
    assert fixed["beta_1"] == 0.9
    assert fixed["beta_2"] == pytest.approx(0.999**kappa)
    assert fixed["learning_rate"] == pytest.approx(kappa * 1e-3)
    assert fixed["epsilon"] == 1e-7


@pytest.mark.parametrize("rule", ["invariant", "sqrt", "power", "fixed_beta_1"])
@pytest.mark.parametrize("kappa", [1, 2, 8])
def test_weight_decay_per_example_and_ema_per_example_are_kept(rule, kappa):
    scaled = ka.scale_hyperparameters(kappa, rule, **BASE, weight_decay=0.04, ema_momentum=0.99)
    # lr' x weight_decay' = kappa x lr x weight_decay; rho' = rho ** kappa
    assert scaled["learning_rate"] * scaled["weight_decay"] == pytest.approx(kappa * 1e-3 * 0.04)
    assert scaled["ema_momentum"] == pytest.approx(0.99**kappa)
    assert "weight_decay" not in ka.scale_hyperparameters(kappa, rule, **BASE)


def test_kappa_1_changes_nothing():
    for rule in ("invariant", "sqrt", "power", "fixed_beta_1"):
        assert ka.scale_hyperparameters(kappa=1, rule=rule, **BASE) == pytest.approx(BASE)


@pytest.mark.parametrize("rule", ["invariant", "sqrt"])
def test_linear_beta_rule_refused_when_meaningless(rule):
    with pytest.raises(
        ValueError,
        match=r"kappa \* \(1 - beta_1\) = 1 >= 1.*"
        r"rule='power'.*Received: kappa=10, beta_1=0.9",
    ):
        ka.scale_hyperparameters(kappa=10, rule=rule, **BASE)
    # The exponent variant is defined there, and beta_1 is kept by fixed_beta_1.
    assert ka.scale_hyperparameters(kappa=10, rule="power", **BASE)["beta_1"] == pytest.approx(
        0.9**10
    )
    assert ka.scale_hyperparameters(kappa=10, rule="fixed_beta_1", **BASE)["beta_1"] == 0.9


def test_unknown_rule_and_bad_kappa():
    with pytest.raises(ValueError, match="Received: rule='linear'"):
        ka.scale_hyperparameters(kappa=2, rule="linear", **BASE)
    for kappa in (0, -1, True, "2", float("inf")):
        with pytest.raises(ValueError, match=f"Received: kappa={kappa!r}"):
            ka.scale_hyperparameters(kappa=kappa, rule="invariant", **BASE)
    for name, value in (("weight_decay", -0.1), ("ema_momentum", 1.5), ("ema_momentum", "x")):
        with pytest.raises(ValueError, match=f"Received: {name}={value!r}"):
            ka.scale_hyperparameters(2, "power", **BASE, **{name: value})


# -- bad input to the API: a ValueError naming the argument, echoing it -------

BAD_CONSTRUCTION = [
    ("beta_1", 1.0),
    ("beta_1", -0.1),
    ("beta_2", 1.0),
    ("beta_2", 1.5),
    ("epsilon", -1e-7),
    ("epsilon", "small"),
    ("learning_rate", -0.1),
    ("weight_decay", -0.01),
]


@pytest.mark.parametrize("name", ["invariant_adam", "update_accumulation_adam"])
@pytest.mark.parametrize("argument, value", BAD_CONSTRUCTION)
def test_bad_hyperparameter(name, argument, value):
    with pytest.raises(ValueError, match=rf"`{argument}` .*Received: {argument}={value!r}$"):
        OPTIMIZERS[name](**{argument: value})


BAD_APPLY = {
    "weight_inf": dict(weight=float("inf"), match=r"`weight` .*Received: weight=inf"),
    "weight_negative": dict(weight=-2, match=r"`weight` .*Received: weight=-2"),
    "weight_bool": dict(weight=True, match=r"`weight` .*Received: weight=True"),
    "weight_vector": dict(weight=tf.constant([1.0, 2.0]), match=r"`weight` .*Received: weight="),
    "weight_array": dict(weight=np.ones(2), match=r"`weight` .*Received: weight=array"),
    "weight_negative_tensor": dict(weight=tf.constant(-1.0), match=r"`weight` .*Received: weight="),
    "fewer_grads": dict(grads=1, match=r"`grads` .*Received: len\(grads\)=1"),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("case", BAD_APPLY)
def test_bad_apply_changes_nothing(name, case):
    case = dict(BAD_APPLY[case])
    variables = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))]
    grads = [tf.ones(2), tf.ones(3)][: case.pop("grads", 2)]
    opt = OPTIMIZERS[name](steps=1)
    with pytest.raises(ValueError, match=case["match"]):
        opt.apply(grads, variables, weight=case.get("weight"))
    for v in variables:
        np.testing.assert_array_equal(v.numpy(), np.ones(v.shape))
    assert not opt.built or int(opt.micro_step) == 0


def test_weigh_micro_batches_bad_argument():
    with pytest.raises(ValueError, match=r"`model` must be a `keras.Model`. Received: model='m'"):
        ka.weigh_micro_batches("m")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="after `model.compile`"):
        ka.weigh_micro_batches(model)
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match=r"Received: reduction='sum'"):
        ka.weigh_micro_batches(model)


# -- wrappers -----------------------------------------------------------------


def test_loss_scale_optimizer_inside_is_refused():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    with pytest.raises(ValueError, match=r"Put the loss scaler outside.*Received: optimizer="):
        ka.GradientAccumulation(inner, steps=4)


def test_get_weights_set_weights_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    micro = rng.normal(size=(9, 3)).astype("float32")

    def run(opt, var, grads):
        for g in grads:
            opt.apply([tf.constant(g)], [var])

    make = lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=3)
    var, opt = keras.Variable(np.zeros(3, "float32")), make()
    run(opt, var, micro[:5])  # mid-window, Adam moments non-zero
    saved, at = opt.get_weights(), var.numpy().copy()
    assert len(saved) == len(opt.variables) > len(opt._variables)  # inner state included
    run(opt, var, micro[5:])

    other_var, other = keras.Variable(at), make()
    other.build([other_var])
    other.set_weights(saved)
    run(other, other_var, micro[5:])
    np.testing.assert_array_equal(other_var.numpy(), var.numpy())
    for a, b in zip(other.get_weights(), opt.get_weights()):
        np.testing.assert_array_equal(a, b)
