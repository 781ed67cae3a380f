"""The contenders: ways of training a model, timed per micro-batch.

To add one, register it; a custom training loop (e.g. one from
`keras_accum.training`) brings its own runner, a class with the interface
of `runner.FitRunner`:

    register(Contender(
        "loop_gradient_accumulation", "GradientAccumulation, custom loop",
        "ours",
        lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(), steps),
        runner=LoopRunner))

and `--contenders=...,loop_gradient_accumulation` times it beside the rest.
"""

import dataclasses

import keras
import tensorflow as tf

import keras_accum as ka
from keras_accum import _compat
from keras_accum.experiments import optimizers


class GradientsOnly(keras.optimizers.Optimizer):
    """Computes the gradients, reads each once and drops them: the
    forward/backward cost alone.

    The gradients must really be consumed. A mere control dependency on them
    is not enough: TensorFlow prunes the pure ops whose results nothing
    reads, and on the MLP (b = 32, graph mode) such a "gradients only" step
    ran in 3.3 ms against 10.4 ms for this one, i.e. most of the backward
    pass (the weight-gradient matmuls) was never run. Here every gradient
    is summed into a scalar variable: one read of each gradient (4 bytes per
    parameter), which any optimizer pays too.
    """

    def __init__(self, name="gradients_only"):
        super().__init__(learning_rate=0.0, name=name)

    def build(self, var_list):
        super().build(var_list)
        self._sink = self.add_variable((), name="sink")

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(list(trainable_variables))
        # A sparse gradient (`tf.IndexedSlices`) is read as its values.
        values = [getattr(g, "values", g) for g in grads if g is not None]
        self._sink.assign(tf.add_n([tf.reduce_sum(tf.cast(g, "float32")) for g in values]))
        _compat.update_counter(self).assign_add(1)


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of training a model, timed per micro-batch of b examples.

    role: "ours" (a keras_accum optimizer), "keras" (Keras's built-in
    accumulation), "adam" (no accumulation), "big_batch" (Adam on N x b) or
    "gradients_only" (forward/backward alone).
    """

    name: str
    label: str
    role: str
    make_optimizer: object  # make_optimizer(steps) -> keras Optimizer
    batch_factor: str = "micro"  # "micro": b per step; "window": N x b.
    runner: object = None  # None: runner.FitRunner.


CONTENDERS = {}
# Keras's defaults: what a user gets from `keras.optimizers.Adam()`.
ADAM = {"learning_rate": 0.001}


def register(contender):
    CONTENDERS[contender.name] = contender
    return contender


def _adam(steps):
    return keras.optimizers.Adam()


for _contender in (
    Contender("adam", "Adam (no accumulation)", "adam", _adam),
    Contender(
        "keras_accumulation",
        "Adam(gradient_accumulation_steps=N)",
        "keras",
        lambda steps: keras.optimizers.Adam(gradient_accumulation_steps=steps),
    ),
    Contender(
        "gradient_accumulation",
        "GradientAccumulation(Adam(), steps=N)",
        "ours",
        lambda steps: optimizers.build("gradient_accumulation", steps, ADAM),
    ),
    Contender(
        "invariant_adam",
        "InvariantAdam(steps=N)",
        "ours",
        lambda steps: optimizers.build("invariant_adam", steps, ADAM),
    ),
    Contender(
        "update_accumulation_adam",
        "UpdateAccumulationAdam(steps=N)",
        "ours",
        lambda steps: optimizers.build("update_accumulation_adam", steps, ADAM),
    ),
    Contender("big_batch", "Adam on one batch of N x b", "big_batch", _adam, "window"),
    Contender(
        "gradients_only",
        "gradients computed then dropped",
        "gradients_only",
        lambda steps: GradientsOnly(),
    ),
    # Not run by default: the cost of the default non-finite check, by
    # difference (`optimizers.build` gives the defaults a user gets).
    Contender(
        "gradient_accumulation_nocheck",
        "GradientAccumulation(Adam(), steps=N, nonfinite=None)",
        "ours",
        lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(), steps=steps, nonfinite=None),
    ),
    Contender(
        "invariant_adam_nocheck",
        "InvariantAdam(steps=N, nonfinite=None)",
        "ours",
        lambda steps: ka.InvariantAdam(steps=steps, nonfinite=None),
    ),
):
    register(_contender)
