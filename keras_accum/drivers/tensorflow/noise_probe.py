"""`NoiseScaleCallback`'s probe on TensorFlow: kappa micro-batches'
gradients in one traced `tf.while_loop`, the model's state restored after."""

import keras

from keras_accum import _backend, _gradients
from keras_accum._backend import tf
from keras_accum._noise_scale import squared_norm


def is_dataset(data):
    """True for a `tf.data.Dataset` of probe batches."""
    return isinstance(data, tf.data.Dataset)


def next_batch(iterator, n):
    """The first `n` examples of the dataset's next batch, checked."""
    data = next(iterator)
    size = tf.nest.flatten(data)[0].shape[0]
    if size < n:
        raise ValueError(
            "`data` batches must hold at least kappa * "
            f"micro_batch_size = {n} examples. Received: {size}"
        )
    return _backend.map_structure(lambda a: a[:n], data)


def as_tensors(data):
    """Tensors of one fixed shape: the traced probe traces once."""
    return _backend.map_structure(tf.convert_to_tensor, data)


def probe_function(callback):
    """The callback's probe, traced once (no AutoGraph)."""
    return tf.function(lambda data: _probe(callback, data), autograph=False)


def _probe(callback, data):
    model, kappa, b = callback.model, callback.kappa, callback.micro_batch_size
    x, y, sw = keras.utils.unpack_x_y_sample_weight(data)

    def split(t):  # [kappa * b, ...] -> [kappa, b, ...]: micro-batch i is t[i]
        return tf.reshape(t, [kappa, b] + t.shape[1:].as_list())

    x, y, sw = _backend.map_structure(split, (x, y, sw))
    weights = model.trainable_variables
    state = model.non_trainable_variables + model.metrics_variables
    saved = [tf.identity(v) for v in state]

    def body(i, small, acc):
        xi, yi, swi = _backend.map_structure(lambda t: t[i], (x, y, sw))
        grads = _gradients.tape_gradients(model, xi, yi, swi)
        grads = [
            _zeros_like(w) if g is None else tf.convert_to_tensor(g) for g, w in zip(grads, weights)
        ]
        return (i + 1, small + squared_norm(grads), [a + g for a, g in zip(acc, grads)])

    _, small, acc = tf.while_loop(
        lambda i, *_: i < kappa,
        body,
        # Not `tf.zeros_like`: a constant the traced probe would hold for good.
        (tf.constant(0), tf.constant(0.0), [_zeros_like(w) for w in weights]),
    )
    for v, s in zip(state, saved):
        v.assign(s)
    # |g_b|^2 = mean_j |g_j|^2 ; |g_B|^2 = |sum_j g_j / kappa|^2
    return callback.tracker.update(small / kappa, squared_norm(acc) / kappa**2, b, kappa * b)


def _zeros_like(variable):
    """Zeros like `variable`, not a held constant (`zeros_like_state`)."""
    value = tf.convert_to_tensor(variable)
    return tf.math.multiply_no_nan(value, tf.zeros((), value.dtype))
