"""Private Keras names keras_accum uses, one place per feature.

Each use says what it is for and the Keras versions it was checked
against; a Keras upgrade is checked here first.
"""

# batch normalization
# (keras_accum.layers: the micro-batch's moments and batch renormalization
# exactly as keras.layers.BatchNormalization computes them, the model being
# called, and the layers and class of a model.)

from keras.src.backend.common import global_state as _global_state
from keras.src.models.functional import Functional as _Functional


def calling_model():
    """The outermost layer of the call in progress (the model `fit`'s
    `train_step` calls), or None outside a call."""
    # "current_call_ctx".entry_layer: Keras's record of the layer a call
    # started from (Layer._get_call_context); checked: Keras 3.15.1.
    context = _global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.entry_layer


def batch_moments(layer, inputs, mask):
    """(mean, biased variance) of a micro-batch per channel, as Keras's
    layer normalizes with them (mask and `synchronized` honoured)."""
    # BatchNormalization._moments; checked: Keras 3.15.1 (also in an
    # earlier 3.x source, with the same signature).
    return layer._moments(inputs, mask)


def renorm_transform(layer, mean, variance, gamma, beta, dtype):
    """(gamma, beta) corrected by batch renormalization's r and d, which
    read the layer's renorm statistics (Keras 3.14+, `renorm=True`)."""
    # BatchNormalization._renorm_correction_and_moments and
    # ._compose_transforms; checked: Keras 3.15.1.
    r, d, _, _ = layer._renorm_correction_and_moments(mean, variance)
    return layer._compose_transforms(r, d, gamma, beta, dtype)


def update_renorm_statistics(layer, mean, variance):
    """The moving and renorm statistics of `renorm=True` moved towards a
    batch's `mean` and `variance`, as Keras's layer moves them."""
    # BatchNormalization._update_renorm_statistics; checked: Keras 3.15.1.
    layer._update_renorm_statistics(mean, variance)


def all_layers(layer):
    """Every layer inside `layer`, nested ones included, not itself."""
    # Layer._flatten_layers(include_self, recursive); checked: Keras 3.15.1.
    return list(layer._flatten_layers(include_self=False, recursive=True))


def is_functional(model):
    """True for a Functional model (what `clone_model` can rebuild)."""
    # keras.src.models.functional.Functional; checked: Keras 3.15.1.
    return isinstance(model, _Functional)
