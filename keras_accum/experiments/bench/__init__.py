"""Speed and memory of the keras_accum optimizers, measured side by side.

`run(BenchConfig())` times, in one process, every contender
(`contenders.CONTENDERS`) on every model (`workloads.WORKLOADS`, built from
`experiments.models`) in every setting (`config.SETTINGS`: graph mode and
XLA with `steps_per_execution` K and 1, MirroredStrategy on 2 logical CPUs)
at the micro-batch b and, in `limit_settings`, at `limit_micro_batch`; it
returns a dict that `report.markdown` and `report.write_outputs` turn into
Markdown, JSON and CSV, with every target of the speed issue checked case by
case (`targets`). `scripts/bench.py` is the command-line entry point.

How a time is taken (`runner`, `group`):

* Each contender gets its own copy of the model, compiled with
  `steps_per_execution = K = steps * windows` (or 1), so that one call of
  Keras's `model.train_function(iterator)` runs K micro-batches (N of them
  per window) in a `tf.while_loop` inside one `tf.function`: this is the
  code `model.fit` runs, without its per-epoch bookkeeping. `model.fit`
  itself does the warm-up. One *sample* is `calls` back-to-back calls
  (calibrated so that a sample lasts about `min_sample_seconds`), divided by
  the number of micro-batches it ran.
* The contenders are sampled round-robin, the first one rotating each round;
  a ratio is the median over rounds of per-round ratios (quartiles as its
  spread). Data are N distinct random micro-batches cached in memory.
  Ratios move more between processes than between rounds: runs of the same
  group merged by `merge_results` pool their rounds (`group.pool_runs`),
  each ratio still taken within its own run.
* The "big batch" contender is plain Adam on batches of N x b. The *limit*
  is N forward/backward passes whose gradients are read once and dropped
  (`gradients_only`) plus one Adam update, per micro-batch.
* Traces are counted with a Python counter around `model.train_step` and
  the tracing counts of the `tf.function`s inside `model.train_function`;
  after warm-up, and after the learning rate changes, the count must not
  move. For `steps`, each of our optimizers is built once more (untimed)
  with `AdaptiveSteps(N, 2N)`, whose window size is a variable; the probe
  doubles it between two calls and counts again.
* Under MirroredStrategy the cross-replica reductions are counted while
  tracing, split into those that run every micro-step and those inside a
  conditional (the window's end).
* Each row records its device (`config.run_device`): a one-replica group
  runs on the GPU when TensorFlow sees one, MirroredStrategy groups on
  logical CPUs. A group is one device, setting, model and micro-batch
  size: pooling, references and targets never cross devices, and the
  report shows a GPU group's setting as "graph on GPU".
* Optimizer memory is the sum of the sizes of `optimizer.variables`, scalars
  excluded, per trainable parameter; peak RSS (VmHWM) and the XLA copies of
  the compiled step are taken in a fresh subprocess per (model, contender),
  the peak tensor memory (TensorFlow's BFC allocator) in one per (model,
  contender, setting) (`memory`, `worker`); MirroredStrategy groups run in
  a subprocess too.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_accum.experiments.bench.config import BenchConfig  # noqa: E402
from keras_accum.experiments.bench.report import (  # noqa: E402
    check_splice,
    markdown,
    splice_markdown,
    write_outputs,
)
from keras_accum.experiments.bench.suite import merge_results, run  # noqa: E402

__all__ = [
    "BenchConfig",
    "check_splice",
    "markdown",
    "merge_results",
    "run",
    "splice_markdown",
    "write_outputs",
]
