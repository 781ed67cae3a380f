"""Every private Keras and TensorFlow name keras_accum uses, with the
versions checked (`.ci/floor` runs the tests on Keras 3.8.0 too).
tests/test_compat.py pins the premises; tests/test_structure.py refuses a
private name elsewhere. Two reliances are not calls, so live elsewhere:
`GradientAccumulation._model_variables_moving_average` (overrides what
Keras reads for `use_ema`) and `GradientAccumulation.__dir__` (hides
`inner_optimizer` from Keras's saving: its state is saved once, as ours).
"""

import contextlib
import sys
import weakref

from keras_accum._backend import tf

# -- model.fit ------------------------------------------------------------------


def compiled_loss(model):
    """The `CompileLoss` of `model.compile`, called as `loss(y, y_pred,
    sample_weight)`. Checked on Keras 3.10-3.15."""
    return model._compile_loss


def set_compiled_loss(model, loss):
    """Replaces `model`'s compiled loss until the next `compile`. Checked
    on Keras 3.10-3.15."""
    model._compile_loss = loss


def keras_mask(tensor):
    """The Keras mask attached to `tensor`, or None (`weigh_micro_batches`,
    `Rematerialized`). Checked on Keras 3.10-3.15."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def fit_context():
    """(model, locals of Keras's `fit`) running the call in progress (also
    from a replica thread), else None. Checked: Keras 3.15.1's trainers."""
    import threading

    frames = [sys._getframe(1)]
    if threading.current_thread() is not threading.main_thread():
        frames.append(sys._current_frames().get(threading.main_thread().ident))
    for frame in frames:
        while frame is not None:
            if frame.f_code.co_name == "fit" and "epoch_iterator" in frame.f_locals:
                return frame.f_locals.get("self"), frame.f_locals
            frame = frame.f_back
    return None


def fit_batch_size(context):
    """The batch size of `fit_context()`'s data adapter, or None."""
    adapter = getattr(context[1].get("epoch_iterator"), "data_adapter", None)
    try:
        return None if getattr(adapter, "batch_size", None) is None else int(adapter.batch_size)
    except NotImplementedError:  # an adapter that cannot tell
        return None


def release_fit(context):
    """Leaves the model usable before raising inside `fit`: JAX's state put
    back, TensorFlow's train function dropped. Checked: Keras 3.15.1."""
    model, local = context
    if hasattr(model, "jax_state_sync") and local.get("state") is not None:
        kinds = ("trainable", "non_trainable", "optimizer", "metrics")
        model._jax_state = {f"{k}_variables": v for k, v in zip(kinds, local["state"])}
        model._jax_state_synced = False
    if hasattr(model, "train_function"):  # Keras traces it again where needed
        model.train_function = None


def loss_tracker(model):
    """The `Mean` behind `fit`'s "loss" log. Checked: Keras 3.15.1."""
    return getattr(model, "_loss_tracker", None)


# -- optimizers -----------------------------------------------------------------


def optimizer_strategy(optimizer):
    """The strategy `optimizer` was created under. Checked on Keras
    3.10-3.15."""
    return optimizer._distribution_strategy


def in_xla():
    """True while tracing for XLA (no public query). Checked on TensorFlow
    2.16-2.21."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


_ASSIGNS = ("assign", "assign_add", "assign_sub")
_MISSING = object()


@contextlib.contextmanager
def routed_assigns(optimizer, writer):
    """`optimizer.assign*` are `writer`'s while the block runs, then put
    back: how XLA keeps a wrapped optimizer's writes (its `update_step`
    writes only through `self.assign*`, pinned by tests/test_compat.py).
    Checked on Keras 3.10-3.15."""
    saved = {name: optimizer.__dict__.get(name, _MISSING) for name in _ASSIGNS}
    for name in _ASSIGNS:
        setattr(optimizer, name, getattr(writer, name))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, value)


# The subclass contract Keras's own optimizers use but do not document.


def check_variables_are_known(optimizer, variables):
    """Keras's "Unknown variable" check of `apply`. Checked on Keras 3.8,
    3.10 and 3.15."""
    optimizer._check_variables_are_known(variables)


def adam_velocities(optimizer):
    """Adam's second moments v (ours share the name), or None. Checked on
    Keras 3.8, 3.10 and 3.15."""
    return getattr(optimizer, "_velocities", None)


def variable_index(optimizer, variable):
    """`variable`'s index in the slot lists. Checked on Keras 3.10-3.15."""
    return optimizer._get_variable_index(variable)


def trainable_variables(optimizer):
    """The variables `optimizer` was built with. Checked on Keras 3.10-3.15."""
    return optimizer._trainable_variables


def own_variables(optimizer):
    """`optimizer`'s variables without a wrapped one's. Checked on Keras
    3.10-3.15."""
    return optimizer._variables


def update_counter(optimizer):
    """The variable behind `iterations`, even where a subclass shows
    another. Checked on Keras 3.10-3.15."""
    return optimizer._iterations


def track_variable(optimizer, variable):
    """Adds `variable` to `optimizer.variables` (replica-local state).
    Checked on Keras 3.10-3.15."""
    optimizer._track_variable(variable)


def variable_layout(variable):
    """`variable`'s `keras.distribution` layout, or None. Checked on Keras
    3.10-3.15."""
    return getattr(variable, "_layout", None)


def learning_rate_schedule(optimizer):
    """The learning rate as given (maybe a schedule). Checked on Keras
    3.10-3.15."""
    return optimizer._learning_rate


def clip_gradients(optimizer, grads):
    """Keras's clipping of `grads`. Checked on Keras 3.10-3.15."""
    return optimizer._clip_gradients(grads)


def uses_weight_decay(optimizer, variable):
    """False where `variable` is exempt. Checked on Keras 3.10-3.15."""
    return optimizer._use_weight_decay(variable)


def ema_averages(optimizer):
    """The weights' EMA, one per variable. Checked on Keras 3.10-3.15."""
    return optimizer._model_variables_moving_average


# -- the custom loop ------------------------------------------------------------


def progbar_seen(bar):
    """Steps a `keras.utils.Progbar` has shown. Checked on Keras 3.10-3.15."""
    return bar._seen_so_far


def metric_function(metric):
    """(fn, kwargs) of a `MeanMetricWrapper`. Checked on Keras 3.10-3.15."""
    return metric._fn, metric._fn_kwargs


def eager_context():
    """TensorFlow's eager context (the peer watch's collective calls).
    Checked on TensorFlow 2.16-2.21."""
    from tensorflow.python.eager import context

    return context.context()


def tensorboard_writers(callback):
    """A `TensorBoard` callback's train and validation writers (None until
    used). Checked on Keras 3.10-3.15."""
    return [callback.__dict__.get(name) for name in ("_train_writer", "_val_writer")]


# -- batch normalization (keras_accum.layers) -------------------------------------


def calling_model():
    """The outermost layer of the call in progress, or None."""
    # "current_call_ctx".entry_layer; checked: Keras 3.15.1.
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.entry_layer


def training_model():
    """Off TensorFlow: the model training the call in progress, or None.
    Under JAX read from the frames: `stateless_call` sets no call context."""
    model = calling_model()
    if getattr(model, "optimizer", None) is not None:
        return model
    # Layer.stateless_call(self, ...) and its `self`; checked: Keras 3.15.1.
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "stateless_call":
            owner = frame.f_locals.get("self")
            if getattr(owner, "optimizer", None) is not None:
                return owner
        frame = frame.f_back
    return model


def batch_moments(layer, inputs, mask):
    """(mean, biased variance) per channel, as Keras's layer computes them."""
    # BatchNormalization._moments; checked: Keras 3.15.1.
    return layer._moments(inputs, mask)


def renorm_transform(layer, mean, variance, gamma, beta, dtype):
    """(gamma, beta) corrected by renorm's r and d (Keras 3.14+)."""
    # checked: Keras 3.15.1.
    r, d, _, _ = layer._renorm_correction_and_moments(mean, variance)
    return layer._compose_transforms(r, d, gamma, beta, dtype)


def layer_own_variables(layer):
    """A layer's own variables in `save_own_variables`' order. Checked on
    Keras 3.8-3.15."""
    return layer._trainable_variables + layer._non_trainable_variables


def write_stamp(tensor):
    """(weak ref, in-place write count `_version`) of a torch tensor.
    Checked on PyTorch 2.5-2.13."""
    return weakref.ref(tensor), tensor._version


def unwritten_since(stamp, tensor):
    """True when nothing wrote `tensor` in place since `stamp`."""
    reference, version = stamp
    return reference() is tensor and tensor._version == version


def in_stateless_scope():
    """True inside a `keras.StatelessScope`. Checked on Keras 3.8-3.15."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside

    return inside()


def all_layers(layer):
    """Every layer inside `layer`, nested ones included, not itself."""
    # checked: Keras 3.15.1.
    return list(layer._flatten_layers(include_self=False, recursive=True))


def is_functional(model):
    """True for a Functional model. Checked: Keras 3.15.1."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


# -- probe gradients under JAX (`keras_accum._gradients`) -------------------------


def call_has_training_arg(model):
    """Whether `model.call` takes `training`. Checked on Keras 3.15."""
    return model._call_has_training_arg


@contextlib.contextmanager
def losses_override(model, losses):
    """`losses` stand in for `model.losses`, as in Keras's JAX trainer.
    Checked on Keras 3.15."""
    if not losses:
        yield
        return
    model._losses_override.clear()
    model._losses_override = losses
    try:
        yield
    finally:
        model._losses_override.clear()


def update_jax_metrics(model, metrics_values, loss, x, y, y_pred, sample_weight):
    """(logs, metrics values) as Keras's JAX `train_step` ends. Checked on
    Keras 3.15."""
    return model._update_metrics_variables(metrics_values, loss, x, y, y_pred, sample_weight)
