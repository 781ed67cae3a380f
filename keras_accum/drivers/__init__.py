"""One driver per backend, chosen once, at import.

An optimizer's class is its *rule*: its state, pure functions of values
(how one micro-batch folds in, the window's step), and the hooks that say
what to write (`_fold`; at the window's end `_window_ok`, `_update`,
`_ema_momentum_of_window`), in `keras.ops`. A *driver* runs the rules on
one backend: it decides the window's start and end, screens non-finite
gradients, counts, and runs the EMA and constraints after an update.

* `drivers.tensorflow`: `tf.distribute` (replica-local state, the window's
  end a `cond` in cross-replica context), XLA, sparse rows. A rule runs
  there as written, per replica; an optimizer may have a *form* there
  (`_tf_fold`, `_tf_update`, ...) that runs its rule's pure functions with
  the driver's services (one batched reduction, sparse rows, compiled
  kernels), as Keras keeps `backend/torch/optimizers/torch_adam.py` beside
  `optimizers/adam.py`.
* `drivers.portable`: JAX (traced: masks) and PyTorch (eager: Python
  branches) run the rules as written.

`AccumulationOptimizer` takes `Driver` as a base class, each optimizer its
form (`InvariantAdam(InvariantAdamForm, AdamFamily)`): the backend is asked
here once, never on a call. `keras_accum.layers.BatchNormalization` takes
its form the same way (`BatchNormalizationForm`).
"""

from keras_accum import _backend

if _backend.IS_TENSORFLOW:
    from keras_accum.drivers.tensorflow import (
        BatchNormalizationForm,
        Driver,
        GradientAccumulationForm,
        InvariantAdamForm,
        UpdateAccumulationAdamForm,
    )
else:
    from keras_accum.drivers.portable import (
        Driver,
        GradientAccumulationForm,
        InvariantAdamForm,
        UpdateAccumulationAdamForm,
    )
    from keras_accum.drivers.portable_batch_norm import BatchNormalizationForm

__all__ = [
    "BatchNormalizationForm",
    "Driver",
    "GradientAccumulationForm",
    "InvariantAdamForm",
    "UpdateAccumulationAdamForm",
]
