"""keras_accum: micro-batch training for Keras 3 on TensorFlow, JAX and PyTorch.

Three optimizers for `model.compile(optimizer=...)`: `GradientAccumulation`
(any Keras optimizer, one step per window of micro-batches),
`UpdateAccumulationAdam` and `InvariantAdam` (batch-size invariant Adam);
`steps` may be a schedule (`PiecewiseSteps`, `AdaptiveSteps`). Also
`scale_hyperparameters`, `layers.BatchNormalization`, `AccumulationLogger`
and `rematerialize`. See docs/index.md.
"""

# No backend is chosen here: `KERAS_BACKEND` or ~/.keras/keras.json decide.
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
