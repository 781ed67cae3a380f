"""Every private Keras and TensorFlow name keras_accum uses, in one place.

The rest of the library uses public API and the documented optimizer
subclass contract (`build`, `update_step`-style hooks, `add_variable`,
`assign*`). Each function here says what it is for and the Keras versions
it was checked on (the sources read); `.ci/floor` also runs the library's
optimizer, fit, saving and batch-norm tests through them on Keras 3.8.0.
When Keras changes one of these names, this is the file to change, and
`tests/test_compat.py` the test that says so; `tests/test_structure.py`
fails on a private Keras or TensorFlow name used anywhere else in the
library (the harness, `keras_accum.experiments`, aside).

Two reliances on Keras internals cannot live here, as they are not calls:

* `GradientAccumulation._model_variables_moving_average` overrides the
  attribute of that name that Keras's optimizer reads for `use_ema`
  (it returns the wrapped optimizer's averages, `ema_averages`).
* `GradientAccumulation.__dir__` hides `inner_optimizer` from Keras's
  saving, which walks what `dir` lists: the wrapped optimizer's state is
  saved once, in this optimizer's `variables`, and restored when it is
  built. A Keras that finds trackables some other way would save and
  load it twice.
"""

import contextlib
import sys
import weakref

from keras_accum._backend import tf

# -- model.fit ------------------------------------------------------------------


def compiled_loss(model):
    """The loss object `model.compile(loss=...)` built (Keras's
    `CompileLoss`), which `Model.compute_loss` calls as
    `loss(y, y_pred, sample_weight)`. Checked on Keras 3.10-3.15."""
    return model._compile_loss


def set_compiled_loss(model, loss):
    """Replaces the compiled loss of `model` (`weigh_micro_batches`); the
    next `compile` replaces it again. Checked on Keras 3.10-3.15."""
    model._compile_loss = loss


def keras_mask(tensor):
    """The Keras mask a layer attached to `tensor` (from
    `Embedding(mask_zero=True)`, `Masking`, ...) or None: what a masked
    loss divides by (`weigh_micro_batches`), and what `Rematerialized`
    passes to its layer explicitly, as Keras's `Layer.__call__` does, so
    that the recomputation sees it too. Checked on Keras 3.10-3.15."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def fit_context():
    """(model, the locals of Keras's `fit`) running the `apply` or `build`
    in progress (this thread's frames, or a `tf.distribute` replica
    thread's main thread), else None. Checked: Keras 3.15.1's trainers."""
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
    """The examples of each batch the `fit` of `fit_context()` trains (its
    data adapter's `batch_size`: `fit`'s, 32 by default for arrays, or a
    dataset's static batch); None when its data does not say."""
    adapter = getattr(context[1].get("epoch_iterator"), "data_adapter", None)
    try:
        return None if getattr(adapter, "batch_size", None) is None else int(adapter.batch_size)
    except NotImplementedError:  # an adapter that cannot tell
        return None


def release_fit(context):
    """Before an error from inside `fit_context()`'s `fit`, its model left
    usable: JAX's `fit` gets its state back (its `finally` restores it);
    TensorFlow's failed train function is dropped. Checked: Keras 3.15.1."""
    model, local = context
    if hasattr(model, "jax_state_sync") and local.get("state") is not None:
        kinds = ("trainable", "non_trainable", "optimizer", "metrics")
        model._jax_state = {f"{k}_variables": v for k, v in zip(kinds, local["state"])}
        model._jax_state_synced = False
    if hasattr(model, "train_function"):  # Keras traces it again where needed
        model.train_function = None


def loss_tracker(model):
    """The `keras.metrics.Mean` behind `fit`'s "loss" log (`total`: loss x
    examples, `count`: examples; reset each epoch). Checked: Keras 3.15.1."""
    return getattr(model, "_loss_tracker", None)


# -- optimizers -----------------------------------------------------------------


def optimizer_strategy(optimizer):
    """The `tf.distribute` strategy a Keras optimizer was created under
    (its variables live there). Checked on Keras 3.10-3.15."""
    return optimizer._distribution_strategy


def in_xla():
    """True while tracing for XLA (`jit_compile=True`): TensorFlow has no
    public query. Checked on TensorFlow 2.16-2.21."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


_ASSIGNS = ("assign", "assign_add", "assign_sub")
_MISSING = object()


@contextlib.contextmanager
def routed_assigns(optimizer, writer):
    """While the block runs, `optimizer.assign`, `assign_add` and
    `assign_sub` are `writer`'s; then what they were is put back.

    Under XLA on one replica `GradientAccumulation` runs its inner Keras
    optimizer's update on every micro-step and keeps its writes only at a
    window's end (a select: a `tf.cond` makes XLA copy every variable the
    branch writes). Keras's TensorFlow optimizer has no stateless route
    (`stateless_apply` raises), and its `update_step` takes no writer but
    writes slots and variables only through `self.assign*` (the premise,
    pinned by `tests/test_compat.py` for Keras's optimizers). Checked on
    Keras 3.10-3.15.
    """
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


# The optimizer-subclass contract that Keras's own optimizers use (adam.py,
# loss_scale_optimizer.py) but does not document as public.


def check_variables_are_known(optimizer, variables):
    """Raises Keras's "Unknown variable" `ValueError` when one of
    `variables` is not among those `optimizer` was built with, the check
    Keras's own `apply` makes. Checked on Keras 3.8, 3.10 and 3.15."""
    optimizer._check_variables_are_known(variables)


def adam_velocities(optimizer):
    """The second moments v of a built `keras.optimizers.Adam`, one per
    trainable variable, or None where `optimizer` has none
    (`sharpness.adam_preconditioner`). `InvariantAdam` and
    `UpdateAccumulationAdam` keep theirs under Keras's name, so that this
    reads them too. Checked on Keras 3.8, 3.10 and 3.15."""
    return getattr(optimizer, "_velocities", None)


def variable_index(optimizer, variable):
    """The index of a trainable `variable` in the lists of slots built by
    `optimizer.build` (what Keras's `adam.py` uses). Checked on Keras
    3.10-3.15."""
    return optimizer._get_variable_index(variable)


def trainable_variables(optimizer):
    """The variables `optimizer` was built with. Checked on Keras 3.10-3.15."""
    return optimizer._trainable_variables


def own_variables(optimizer):
    """`optimizer`'s own variables, without those of an optimizer it wraps
    (Keras's `variables` of a wrapper adds them). Checked on Keras 3.10-3.15."""
    return optimizer._variables


def update_counter(optimizer):
    """The variable behind `optimizer.iterations`, also where a subclass
    shows another counter as `iterations` (`GradientAccumulation` shows its
    inner optimizer's). Checked on Keras 3.10-3.15."""
    return optimizer._iterations


def track_variable(optimizer, variable):
    """Makes `variable` part of `optimizer.variables` (its saved state),
    for a variable `add_variable` cannot make (replica-local). Checked on
    Keras 3.10-3.15."""
    optimizer._track_variable(variable)


def variable_layout(variable):
    """The layout `keras.distribution` gave `variable` (None without one):
    what Keras's `add_variable_from_reference` passes to a slot so that it
    is sharded as its parameter. Checked on Keras 3.10-3.15."""
    return getattr(variable, "_layout", None)


def learning_rate_schedule(optimizer):
    """The learning rate as given (a float, a variable, a schedule or a
    callable), before Keras evaluates it at `iterations`. Checked on Keras
    3.10-3.15."""
    return optimizer._learning_rate


def clip_gradients(optimizer, grads):
    """Keras's `clipnorm`, `clipvalue` and `global_clipnorm` applied to
    `grads`. Checked on Keras 3.10-3.15."""
    return optimizer._clip_gradients(grads)


def uses_weight_decay(optimizer, variable):
    """False where `exclude_from_weight_decay` exempts `variable`. Checked
    on Keras 3.10-3.15."""
    return optimizer._use_weight_decay(variable)


def ema_averages(optimizer):
    """The moving averages of the weights (`use_ema=True`), one per
    trainable variable. Checked on Keras 3.10-3.15."""
    return optimizer._model_variables_moving_average


# -- the custom loop ------------------------------------------------------------


def progbar_seen(bar):
    """Steps a `keras.utils.Progbar` has shown. Checked on Keras 3.10-3.15."""
    return bar._seen_so_far


def metric_function(metric):
    """The function of a `keras.metrics.MeanMetricWrapper` (per-item
    values, before the mean) and its keyword arguments. Checked on Keras
    3.10-3.15."""
    return metric._fn, metric._fn_kwargs


def eager_context():
    """TensorFlow's eager context, whose `check_collective_ops_peer_health`
    and `abort_collective_ops` the multi-worker peer watch calls (no public
    route). Checked on TensorFlow 2.16-2.21."""
    from tensorflow.python.eager import context

    return context.context()


def tensorboard_writers(callback):
    """The summary writers a `keras.callbacks.TensorBoard` has opened (its
    train and validation writers, None until used). Checked on Keras
    3.10-3.15."""
    return [callback.__dict__.get(name) for name in ("_train_writer", "_val_writer")]


# -- batch normalization ----------------------------------------------------------
# (keras_accum.layers: the micro-batch's moments and batch renormalization
# exactly as keras.layers.BatchNormalization computes them, the model being
# called, and the layers and class of a model.)


def calling_model():
    """The outermost layer of the call in progress (the model `fit`'s
    `train_step` calls), or None outside a call."""
    # "current_call_ctx".entry_layer: Keras's record of the layer a call
    # started from (Layer._get_call_context); checked: Keras 3.15.1.
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.entry_layer


def training_model():
    """Off TensorFlow: the model whose training step runs the call in
    progress, or None. `calling_model()` under PyTorch (Keras's `train_step`
    calls `model(x)`); under JAX the model whose `stateless_call` runs it:
    Keras's JAX trainer runs the forward pass as `model.stateless_call`,
    which calls `call`, not `__call__`, so no call context names the model
    (read from the caller's frames, once per trace)."""
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


def layer_own_variables(layer):
    """The variables a layer saves itself, in the order
    `Layer.save_own_variables` writes them (trainable, then non-trainable,
    its sub-layers' left out): `layers.BatchNormalization` loads files of
    another backend with more or fewer counters. Checked on Keras 3.8-3.15."""
    return layer._trainable_variables + layer._non_trainable_variables


def write_stamp(tensor):
    """(a weak reference to `tensor`, its in-place write count) of a
    PyTorch tensor: `_version` is torch's own counter of in-place writes
    (what autograd checks saved tensors with; Keras's PyTorch `assign` is
    an in-place `copy_`). Checked on PyTorch 2.5-2.13."""
    return weakref.ref(tensor), tensor._version


def unwritten_since(stamp, tensor):
    """True when `tensor` is the tensor of `stamp` and nothing wrote it in
    place since (`write_stamp`)."""
    reference, version = stamp
    return reference() is tensor and tensor._version == version


def in_stateless_scope():
    """True inside a `keras.StatelessScope` (`stateless_apply`), where a
    variable's writes must go to the scope, not to its tensor in place
    (`keras_accum.kernels`). Checked on Keras 3.8-3.15."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside

    return inside()


def all_layers(layer):
    """Every layer inside `layer`, nested ones included, not itself."""
    # Layer._flatten_layers(include_self, recursive); checked: Keras 3.15.1.
    return list(layer._flatten_layers(include_self=False, recursive=True))


def is_functional(model):
    """True for a Functional model (what `clone_model` can rebuild)."""
    # keras.src.models.functional.Functional; checked: Keras 3.15.1.
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


# -- probe gradients under JAX (`keras_accum._gradients`) -------------------------


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument (Keras's own test,
    what its trainers pass it by). Checked on Keras 3.15."""
    return model._call_has_training_arg


@contextlib.contextmanager
def losses_override(model, losses):
    """`losses` (a stateless forward pass's regularization losses) stand in
    for `model.losses` while the loss is computed, as Keras's JAX trainer
    does it. Checked on Keras 3.15."""
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
    """(logs, metrics values) after a JAX train step, as Keras's JAX
    `train_step` ends (`PerDeviceGradients`). Checked on Keras 3.15."""
    return model._update_metrics_variables(metrics_values, loss, x, y, y_pred, sample_weight)
