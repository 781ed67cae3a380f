"""Which Keras backend runs, and TensorFlow only where it does.

Under `KERAS_BACKEND=tensorflow` `tf` is the TensorFlow module. Under JAX or
PyTorch it is a stand-in, so that importing keras_accum imports no
TensorFlow (which on a GPU would take the device's memory from JAX): an
`isinstance` against it is False, and any call names the TensorFlow-only
feature that was used.
"""

import contextlib
import functools
import operator

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()
IS_TENSORFLOW = BACKEND == "tensorflow"
# The counters' integer dtype, as Keras's `iterations`: int64 under
# TensorFlow and int32 under JAX (without x64) and PyTorch.
INT = keras.backend.standardize_dtype("int")


class _TensorFlowOnly(type):
    """A TensorFlow name under another backend: a class no value is an
    instance of, whose call raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _TensorFlowOnly(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(
            f"`{cls.__name__}` is TensorFlow, and Keras runs on {BACKEND}: this "
            "feature of keras_accum needs KERAS_BACKEND=tensorflow (see the "
            "README's table of what each backend offers)."
        )


if IS_TENSORFLOW:
    import tensorflow as tf
else:
    tf = _TensorFlowOnly("tf", (), {})


# A `tf.Module` under TensorFlow (`tf.train.Checkpoint` finds its
# variables), a plain object elsewhere.
Module = tf.Module if IS_TENSORFLOW else object


def map_structure(fn, struct):
    """`fn` on every leaf of `struct`, a `None` leaf (no sample weight)
    left alone: `tf.nest` under TensorFlow, `keras.tree` elsewhere."""
    nest = tf.nest if IS_TENSORFLOW else keras.tree
    return nest.map_structure(lambda t: None if t is None else fn(t), struct)


def flatten(struct):
    """The leaves of `struct` (`tf.nest` under TensorFlow, `keras.tree`
    elsewhere)."""
    return (tf.nest if IS_TENSORFLOW else keras.tree).flatten(struct)


def add_n(terms):
    """The sum of a list of tensors (`tf.add_n` under TensorFlow)."""
    if IS_TENSORFLOW:
        return tf.add_n(terms)
    return functools.reduce(operator.add, terms)


def static_value(value):
    """`value`'s number when known now (a Python number, a constant, an
    eager tensor), else None (traced)."""
    if isinstance(value, (int, float, np.number)):
        return value
    if IS_TENSORFLOW:
        return tf.get_static_value(value)
    if not is_concrete(value):
        return None
    return np.asarray(ops.convert_to_numpy(value))


def init_scope():
    """TensorFlow's `init_scope` (eagerly, also while a graph is traced);
    nothing elsewhere, where Python runs eagerly."""
    return tf.init_scope() if IS_TENSORFLOW else contextlib.nullcontext()


def scalar_int(value):
    """A scalar variable's value as an int, eagerly. Not through
    convert_to_numpy: NumPy 2 deprecates Keras's `Variable.__array__` (no
    `copy` argument), so under `-W error` every `fit` failed. Under
    TensorFlow the value may be a MirroredVariable, which int() refuses."""
    return int(tf.convert_to_tensor(value) if IS_TENSORFLOW else value)


def require_tensorflow(feature):
    """Raises, in one line, when `feature` runs under another backend."""
    if not IS_TENSORFLOW:
        raise RuntimeError(
            f"{feature} needs the TensorFlow backend (KERAS_BACKEND=tensorflow); "
            f"Keras runs on {BACKEND} here. See the README's table of what each "
            "backend offers."
        )


def wide_float():
    """ "float64", or "float32" under JAX without `jax_enable_x64` (where a
    float64 variable would silently hold float32): the dtype of state kept
    wide for exact sums (`AdaptiveSteps`)."""
    if BACKEND == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return "float32"
    return "float64"


def executing_eagerly():
    """False while TensorFlow traces a graph; True under JAX and PyTorch,
    whose Python runs the steps it calls (JAX's `jit` traces, but Keras
    calls what reads values outside it)."""
    return tf.executing_eagerly() if IS_TENSORFLOW else True


def is_concrete(value):
    """True when `value`'s number can be read now: not a symbolic
    TensorFlow tensor, not a traced JAX value."""
    if IS_TENSORFLOW:
        return not tf.is_symbolic_tensor(value) and hasattr(value, "numpy")
    try:
        bool(value)
    except Exception:  # a JAX tracer refuses `bool`
        return False
    return True
