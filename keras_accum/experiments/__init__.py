"""The harness around the library: datasets, models, config-driven runs,
the invariance study and the benchmark.

Installed with the `experiments` extra (`pip install -e '.[experiments]'`:
tensorflow-datasets, mnist1d, absl-py, tensorboard, matplotlib). The library
(`keras_accum`, `keras_accum.training`) never imports it.
"""
