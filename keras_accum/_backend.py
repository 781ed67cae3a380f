"""Which Keras backend runs; `tf` is TensorFlow only under it, elsewhere a
stand-in (no TensorFlow import, which would take a GPU from JAX) that no
value is an instance of and whose calls raise naming the feature.
"""

import contextlib
import functools
import operator

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()
IS_TENSORFLOW = BACKEND == "tensorflow"
# The counters' dtype, as `iterations`': int64 on TensorFlow, else int32.
INT = keras.backend.standardize_dtype("int")


class _TensorFlowOnly(type):
    """A TensorFlow name under another backend."""

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


# `tf.Module` (so `tf.train.Checkpoint` finds variables), else `object`.
Module = tf.Module if IS_TENSORFLOW else object


def map_structure(fn, struct):
    """`fn` on every non-None leaf of `struct`."""
    nest = tf.nest if IS_TENSORFLOW else keras.tree
    return nest.map_structure(lambda t: None if t is None else fn(t), struct)


def flatten(struct):
    """The leaves of `struct`."""
    return (tf.nest if IS_TENSORFLOW else keras.tree).flatten(struct)


def add_n(terms):
    """The sum of a list of tensors (`tf.add_n` under TensorFlow)."""
    if IS_TENSORFLOW:
        return tf.add_n(terms)
    return functools.reduce(operator.add, terms)


def static_value(value):
    """`value`'s number when known now, else None (traced)."""
    if isinstance(value, (int, float, np.number)):
        return value
    if IS_TENSORFLOW:
        return tf.get_static_value(value)
    if not is_concrete(value):
        return None
    return np.asarray(ops.convert_to_numpy(value))


def init_scope():
    """TensorFlow's `init_scope`; nothing elsewhere."""
    return tf.init_scope() if IS_TENSORFLOW else contextlib.nullcontext()


def scalar_int(value):
    """A scalar variable as an int. Not `convert_to_numpy` (NumPy 2 warns on
    `Variable.__array__`); a MirroredVariable needs `convert_to_tensor`."""
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
    """ "float64", or "float32" under JAX without x64 (silently float32)."""
    if BACKEND == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return "float32"
    return "float64"


def executing_eagerly():
    """False while TensorFlow traces; True under JAX and PyTorch."""
    return tf.executing_eagerly() if IS_TENSORFLOW else True


def is_concrete(value):
    """True when `value`'s number can be read now (not traced)."""
    if IS_TENSORFLOW:
        return not tf.is_symbolic_tensor(value) and hasattr(value, "numpy")
    try:
        bool(value)
    except Exception:  # a JAX tracer refuses `bool`
        return False
    return True
