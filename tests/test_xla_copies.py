"""No parameter-sized copies in the compiled XLA step.

A `tf.cond` at the window's end that writes the variables makes XLA copy
them on every micro-step that does not end a window; under XLA the window
end is a select instead (`keras_accum.drivers.tensorflow._execution.keep_where`). This reads the
optimised HLO of one XLA-compiled step of a small MLP and counts the
elements that `copy` instructions move, as the benchmark does
(`keras_accum.experiments.probes.count_copies`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum as ka
from keras_accum.experiments.probes import count_copies

STEPS = 4
DEFAULTS = {
    "gradient_accumulation": lambda: ka.GradientAccumulation(keras.optimizers.Adam(), STEPS),
    "invariant_adam": lambda: ka.InvariantAdam(steps=STEPS),
    "update_accumulation_adam": lambda: ka.UpdateAccumulationAdam(steps=STEPS),
}


class CondSGD(keras.optimizers.SGD):
    """SGD stepping inside a `tf.cond` on every other call: the pattern
    that copies (the control of the probe)."""

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)

        def step():
            for g, v in zip(grads, trainable_variables):
                v.assign_sub(0.1 * g)

        tf.cond(self.iterations % 2 == 0, step, lambda: None)
        self.iterations.assign_add(1)


def copied_parameters(optimizer):
    """Elements copied per step in the entry computation and in conditional
    branches (what runs every micro-step), over the number of parameters."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((24,)), keras.layers.Dense(40, activation="relu"), keras.layers.Dense(5)]
    )
    variables = model.trainable_variables
    optimizer.build(variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        optimizer.apply(tape.gradient(value, variables), variables)

    x, y = tf.zeros((8, 24)), tf.zeros((8,), "int32")
    hlo = step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
    counts = count_copies(line + "\n" for line in hlo.splitlines())
    return (counts["entry"] + counts["branches"]) / sum(int(np.prod(v.shape)) for v in variables)


def test_the_probe_sees_the_copies_of_a_cond():
    assert copied_parameters(CondSGD(0.1)) >= 1.0


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_no_parameter_sized_copy_at_default_settings(name):
    # Scalars (counters) may be copied; no tensor of parameters' size.
    assert copied_parameters(DEFAULTS[name]()) < 0.05
