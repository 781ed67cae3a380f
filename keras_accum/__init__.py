"""keras_accum: micro-batch training for Keras 3 on TensorFlow."""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

__version__ = "0.1.0"
