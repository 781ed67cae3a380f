"""keras_accum: micro-batch training for Keras 3 on TensorFlow, JAX and PyTorch.

Three optimizers, each usable with `model.compile(optimizer=...)`:

* `GradientAccumulation(optimizer, steps)`: weighted mean of micro-batch
  gradients, one step of any Keras optimizer per window.
* `UpdateAccumulationAdam(learning_rate, steps)`: Adam's moments see every
  micro-batch; the summed updates are applied every `steps` micro-batches.
* `InvariantAdam(learning_rate, steps)`: batch-size invariant Adam.

`scale_hyperparameters` gives the learning rate and betas for a new number
of micro-batches per update. `steps` may also be a schedule
(`PiecewiseSteps`, `AdaptiveSteps`) that changes the window size during a
run; `InvariantAdam(scaling_rule=...)` then rescales its hyperparameters
per window.

`keras_accum.layers.BatchNormalization` moves its moving statistics once per
window, to the statistics of the window's items (`convert_batch_normalization`
swaps it in for Keras's layer).

`AccumulationLogger()` puts updates, examples, the window size and the
window's mean loss into `model.fit`'s logs (History, `CSVLogger`).

`rematerialize(model, "full")` returns a model (sharing `model`'s variables)
that recomputes its layers in the backward pass: less activation memory
when one micro-batch does not fit.
"""

# No backend is chosen here: `KERAS_BACKEND` or ~/.keras/keras.json decide,
# as for Keras itself. The scripts and the harness, which need TensorFlow,
# set it themselves or refuse in one line.
import keras as _keras

from keras_accum import _floor  # noqa: E402

# Before any other module of ours: an older Keras fails here, in one line.
_floor.check_keras(_keras.__version__)

from keras_accum import layers  # noqa: E402
from keras_accum.accumulation_logger import AccumulationLogger  # noqa: E402
from keras_accum.adaptive_steps import AdaptiveSteps  # noqa: E402
from keras_accum.gradient_accumulation import GradientAccumulation  # noqa: E402
from keras_accum.invariant_adam import InvariantAdam  # noqa: E402
from keras_accum.per_device import PerDeviceGradients  # noqa: E402
from keras_accum.remat import rematerialize  # noqa: E402
from keras_accum.scaling import scale_hyperparameters  # noqa: E402
from keras_accum.schedules import PiecewiseSteps  # noqa: E402
from keras_accum.update_accumulation_adam import (  # noqa: E402
    UpdateAccumulationAdam,
)
from keras_accum.weighing import weigh_micro_batches  # noqa: E402

__version__ = "0.3.0"
__all__ = [
    "AccumulationLogger",
    "AdaptiveSteps",
    "GradientAccumulation",
    "InvariantAdam",
    "PerDeviceGradients",
    "PiecewiseSteps",
    "UpdateAccumulationAdam",
    "layers",
    "rematerialize",
    "scale_hyperparameters",
    "weigh_micro_batches",
]
