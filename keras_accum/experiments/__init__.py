"""The harness around the library: datasets, models, config-driven runs,
the invariance study and the benchmark.

Installed with the `experiments` extra (`pip install -e '.[experiments]'`:
tensorflow-datasets, mnist1d, absl-py, tensorboard, matplotlib). The library
(`keras_accum`, `keras_accum.training`) never imports it.
"""

from keras_accum import _backend

# The datasets, models and studies are TensorFlow (tf.data, tf.function).
_backend.require_tensorflow("The experiment harness (`keras_accum.experiments`, the scripts)")
