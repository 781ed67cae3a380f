"""The premises of `keras_accum._compat`, checked against the installed Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka
from keras_accum import _compat

# Keras optimizers a user may wrap in GradientAccumulation.
KERAS_OPTIMIZERS = {
    "Adam": lambda: keras.optimizers.Adam(0.1),
    "AdamW": lambda: keras.optimizers.AdamW(0.1, weight_decay=0.1),
    "SGD_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.1, momentum=0.5, centered=True),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "Adadelta": lambda: keras.optimizers.Adadelta(0.1),
    "Adamax": lambda: keras.optimizers.Adamax(0.1),
    "Nadam": lambda: keras.optimizers.Nadam(0.1),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "Lion": lambda: keras.optimizers.Lion(0.1),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.1),
}


class Recorder:
    """`assign*` that write nothing and count their calls."""

    def __init__(self):
        self.calls = 0

    def assign(self, variable, value):
        self.calls += 1

    assign_add = assign_sub = assign


@pytest.mark.parametrize("name", sorted(KERAS_OPTIMIZERS))
def test_keras_update_step_writes_only_through_assign_methods(name):
    # The premise of `routed_assigns`: with the three methods routed to a
    # writer that writes nothing, `update_step` leaves every variable and
    # every slot as it was.
    optimizer = KERAS_OPTIMIZERS[name]()
    variables = [keras.Variable(np.ones((3, 2), "float32")), keras.Variable(np.ones(4, "float32"))]
    optimizer.build(variables)
    before = [v.numpy().copy() for v in variables + list(optimizer.variables)]
    recorder = Recorder()
    with _compat.routed_assigns(optimizer, recorder):
        for variable in variables:
            grad = tf.fill(variable.shape, 0.5)
            optimizer.update_step(grad, variable, tf.constant(0.1))
    after = [v.numpy() for v in variables + list(optimizer.variables)]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert recorder.calls >= len(variables)


def test_routed_assigns_puts_back_what_it_replaced():
    optimizer = keras.optimizers.Adam()
    own = lambda variable, value: None
    optimizer.assign_add = own  # an instance attribute of the user's
    with _compat.routed_assigns(optimizer, Recorder()):
        assert optimizer.assign is not type(optimizer).assign
    assert optimizer.assign_add is own
    assert "assign" not in optimizer.__dict__ and "assign_sub" not in optimizer.__dict__


def test_no_method_is_left_on_the_inner_optimizer_after_an_xla_step():
    inner = keras.optimizers.Adam(0.1)
    optimizer = ka.GradientAccumulation(inner, steps=2)
    variable = keras.Variable(np.ones(3, "float32"))

    @tf.function(jit_compile=True)
    def step():
        optimizer.apply([tf.ones(3)], [variable])

    for _ in range(3):
        step()
    assert not set(vars(inner)) & {"assign", "assign_add", "assign_sub"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: ka.UpdateAccumulationAdam(0.1, steps=2),
        lambda: ka.InvariantAdam(0.1, steps=2),
        lambda: ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2),
    ],
)
def test_apply_refuses_a_variable_the_optimizer_was_not_built_with(make):
    # check_variables_are_known: Keras's check, as its own apply makes it.
    optimizer = make()
    known, stranger = (keras.Variable(np.ones(3, "float32")) for _ in range(2))
    optimizer.apply([tf.ones(3)], [known])
    with pytest.raises(ValueError, match="Unknown variable"):
        optimizer.apply([tf.ones(3)], [stranger])


def test_adam_velocities_is_keras_adams_v():
    adam = keras.optimizers.Adam(0.1, beta_2=0.9)
    variable = keras.Variable(np.ones(3, "float32"))
    grads = [np.array([1.0, -2.0, 3.0], "float32"), np.array([0.5, 0.0, -1.0], "float32")]
    for g in grads:
        adam.apply([tf.constant(g)], [variable])
    expected = 0.9 * 0.1 * grads[0] ** 2 + 0.1 * grads[1] ** 2
    [v] = _compat.adam_velocities(adam)
    np.testing.assert_allclose(v.numpy(), expected, rtol=1e-6)
    assert _compat.adam_velocities(keras.optimizers.SGD(0.1)) is None
