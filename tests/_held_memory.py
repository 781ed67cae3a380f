"""Run by tests/test_held_memory.py in a fresh process (TensorFlow's BFC
CPU allocator must be chosen before TensorFlow starts): trains a model of
one 1024 x 2048 kernel (8 MB) a few graph-mode calls with each optimizer
(and calls the gradient noise scale probe a few times) and prints, as JSON,
the bytes the allocator holds after the calls beyond what it held before
them (the model, the optimizer's state and the data were all allocated by
then)."""

import json
import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum as ka  # noqa: E402
from keras_accum import diagnostics  # noqa: E402

STEPS = 4


class ZeroingSGD(keras.optimizers.SGD):
    """SGD that zeroes a slot with `tf.zeros_like` in a branch it never
    takes: the pattern that holds a parameter-sized constant (the control)."""

    def build(self, var_list):
        super().build(var_list)
        self._slot = [self.add_variable_from_reference(v, "slot") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        slot = self._slot[self._get_variable_index(variable)]
        tf.cond(self.iterations < 0, lambda: slot.assign(tf.zeros_like(slot)), lambda: slot)


OPTIMIZERS = {
    "control_zeros_like": lambda: ZeroingSGD(0.01),
    "gradient_accumulation": lambda: ka.GradientAccumulation(keras.optimizers.Adam(), STEPS),
    "gradient_accumulation_skip_micro_batch": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(), STEPS, nonfinite="skip_micro_batch"
    ),
    "invariant_adam": lambda: ka.InvariantAdam(steps=STEPS),
    "update_accumulation_adam": lambda: ka.UpdateAccumulationAdam(steps=STEPS),
}


def model_and_data(compile_args, items):
    """A model of one 1024 x 2048 kernel (8 MB), compiled, and `items`
    random examples."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048, use_bias=False)])
    model.compile(loss="mse", **compile_args)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(items, 1024)).astype("float32")
    y = rng.normal(size=(items, 2048)).astype("float32")
    return model, x, y


def held_after(call):
    """Bytes the allocator holds after three `call()`s beyond before them."""
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    for _ in range(3):
        call()
    return tf.config.experimental.get_memory_info("CPU:0")["current"] - before


def held_bytes(make_optimizer):
    compile_args = {"optimizer": make_optimizer(), "steps_per_execution": STEPS}
    model, x, y = model_and_data(compile_args, STEPS * 8)
    model.optimizer.build(model.trainable_variables)
    iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat())
    model.make_train_function()
    return held_after(lambda: model.train_function(iterator))


def held_by_noise_scale_probe():
    """The same for the gradient noise scale probe (a traced while loop
    over kappa micro-batches)."""
    model, x, y = model_and_data({"optimizer": "sgd"}, 16)
    callback = diagnostics.NoiseScaleCallback((x, y), micro_batch_size=4, kappa=4, seed=0)
    callback.set_model(model)
    probe = callback._next_probe()
    return held_after(lambda: callback.probe_fn(probe))


held = {name: held_bytes(make) for name, make in OPTIMIZERS.items()}
held["noise_scale_probe"] = held_by_noise_scale_probe()
print(json.dumps(held))
