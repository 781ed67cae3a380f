"""Test setup: two logical CPU devices, so MirroredStrategy has 2 replicas.

Logical devices must be configured before TensorFlow initialises its
runtime, which is why this happens at import time of the test session.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)
