"""A tiny training job run as a subprocess by the tests.

Linear regression on a fixed random data set with a shuffled order that
changes every epoch (fixed seed) and a short last batch. Under TF_CONFIG it
runs as one worker of a MultiWorkerMirroredStrategy; otherwise on
`--replicas` logical CPUs. The chief writes the final weights to
`<workdir>/final.npz`.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

parser = argparse.ArgumentParser()
parser.add_argument("--workdir", required=True)
parser.add_argument(
    "--optimizer", default="ga_adam", choices=["ga_adam", "ga_sgd", "invariant", "update"]
)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--items", type=int, default=44)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--checkpoint_every", type=int, default=2)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--collective_timeout", type=float, default=None)
# Seconds of Python work (as tracing a big step) before the model is built.
parser.add_argument("--busy", type=float, default=0.0)
flags = parser.parse_args()

import tensorflow as tf  # noqa: E402

if flags.replicas > 1 and "TF_CONFIG" not in os.environ:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * flags.replicas,
    )
tf.config.experimental.enable_op_determinism()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum as ka  # noqa: E402
from keras_accum import training  # noqa: E402

if "TF_CONFIG" in os.environ:
    strategy = training.strategy_from_environment(flags.collective_timeout)
    print("cluster formed", flush=True)
elif flags.replicas > 1:
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(flags.replicas)])
else:
    strategy = tf.distribute.get_strategy()

rng = np.random.RandomState(0)
x = rng.randn(flags.items, 4).astype("float32")
y = (x @ rng.randn(4, 2) + 0.1 * rng.randn(flags.items, 2)).astype("float32")
dataset = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .shuffle(64, seed=1, reshuffle_each_iteration=True)
    .batch(flags.batch)
)


def slow_down(logs):
    print(f"window {int(logs['batches'])}", flush=True)
    time.sleep(flags.sleep)


def run():
    busy_until = time.monotonic() + flags.busy
    while time.monotonic() < busy_until:
        time.sleep(0.01)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = {
            "ga_adam": lambda: ka.GradientAccumulation(
                keras.optimizers.Adam(0.05), steps=flags.steps
            ),
            "ga_sgd": lambda: ka.GradientAccumulation(
                keras.optimizers.SGD(0.05), steps=flags.steps
            ),
            "invariant": lambda: ka.InvariantAdam(0.05, steps=flags.steps),
            "update": lambda: ka.UpdateAccumulationAdam(0.05, steps=flags.steps),
        }[flags.optimizer]()

    training.train(
        model,
        optimizer,
        "mse",
        dataset,
        epochs=flags.epochs,
        strategy=strategy,
        workdir=flags.workdir,
        checkpoint_every=flags.checkpoint_every,
        callbacks=[slow_down],
        verbose=0,
        resume_hint=f"the same command (continues from {flags.workdir})",
    )
    if training.is_chief(strategy):
        np.savez(os.path.join(flags.workdir, "final.npz"), *model.get_weights())


# As in scripts/train.py: a worker lost at any moment (also while the model
# is built) is a WorkerLostError with the resume hint.
with training.distribute.peer_errors(f"the same command (continues from {flags.workdir})"):
    run()
print("done", flush=True)
sys.exit(0)
