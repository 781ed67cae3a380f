"""Every private Keras and TensorFlow name keras_accum uses, in one place.

The rest of the library uses public API and the documented optimizer
subclass contract (`build`, `update_step`-style hooks, `add_variable`,
`assign*`). Each function here says what it is for and the Keras versions
it was checked on; when Keras changes one of these names, this is the file
to change, and `tests/test_compat.py` the test that says so.
"""

import contextlib

import tensorflow as tf

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
    """The Keras mask a layer attached to `tensor` (None if none): what a
    masked loss divides by. Checked on Keras 3.10-3.15."""
    return getattr(tensor, "_keras_mask", None)


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
