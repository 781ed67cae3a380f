"""The backend's driver and the optimizers' and BatchNormalization's forms
(mixins), chosen once at import: `drivers.tensorflow` or `drivers.portable`
(JAX, PyTorch). See docs/ARCHITECTURE.md.
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
