"""Test setup: two logical CPU devices, so MirroredStrategy has 2 replicas.

Logical devices must be configured before TensorFlow initialises its
runtime, which is why this happens at import time of the test session.
"""

import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)


@functools.cache
def mirrored_strategy():
    """The one MirroredStrategy (2 logical CPUs) of the test session.

    On CPUs it all-reduces with collective ops, and every instance starts its
    collective keys at the same group key: a second instance running other
    collectives in the same process collides with the first ("Shape mismatch
    in the collective instance"), a TensorFlow limitation. Tests share this
    one; a test needing other cross-device ops must avoid collectives.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def micro_steps(trainer, dataset, count):
    """Feeds the first `count` batches of `dataset` to `trainer.micro_batch_step`,
    one global micro-batch per call (a fresh iterator: the trainer's data
    counters, not the iterator, carry the position across a restore)."""
    iterator = iter(trainer.distribute(dataset))
    for _ in range(count):
        trainer.micro_batch_step(iterator)


# A worker script run as a subprocess, not a test module (doctest collection
# would import it and run its argument parser).
collect_ignore = ["_train_job.py"]
