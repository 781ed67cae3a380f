"""Which Keras backend runs, and TensorFlow only where it does.

Under `KERAS_BACKEND=tensorflow` `tf` is the TensorFlow module. Under JAX or
PyTorch it is a stand-in, so that importing keras_accum imports no
TensorFlow (which on a GPU would take the device's memory from JAX): an
`isinstance` against it is False, and any call names the TensorFlow-only
feature that was used.
"""

import keras

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
