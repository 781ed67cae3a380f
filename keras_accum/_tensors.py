"""Gradients as tensors: dense or sparse (`tf.IndexedSlices`), and zeros.

An `Embedding`'s gradient is a `tf.IndexedSlices`: only the rows of the
tokens seen, possibly repeated. The optimizers keep a large one sparse
(`sparse_or_dense`) and make a small one dense.
"""

from keras_accum._backend import tf

# A sparse gradient of a variable with fewer elements than this is made
# dense: the sparse fold's few extra ops (a scatter; in InvariantAdam a sort
# and a segment sum) cost more there than the pass over the variable they
# save (see BENCHMARKS.md, "Sparse gradients").
SPARSE_MIN_ELEMENTS = 65536


def dense(grad):
    """Gradients as dense tensors (an Embedding gives `tf.IndexedSlices`)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def values_of(grad):
    """The tensor holding a gradient's numbers: `grad` itself, or the rows
    of a `tf.IndexedSlices`."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def map_values(fn, grad):
    """`grad` with `fn` applied to its numbers (`values_of`), kept sparse."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def sparse_or_dense(grad, variable):
    """`grad` as it is when it is a `tf.IndexedSlices` of a variable with
    `SPARSE_MIN_ELEMENTS` or more elements (kept sparse), else dense."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    count = tf.TensorShape(variable.shape).num_elements()
    if count is not None and count >= SPARSE_MIN_ELEMENTS:
        return grad
    return dense(grad)


def combine_rows(slices):
    """(rows, values) of a `tf.IndexedSlices` with its repeated rows summed:
    row k of `values` is the sum of every slice of `rows[k]`, as in the
    dense gradient. Static shapes (the slices' count), for XLA: the rows
    beyond the distinct ones come back as row 0 with zero values."""
    count = tf.shape(slices.indices)[0]
    order = tf.argsort(slices.indices)
    rows = tf.gather(slices.indices, order)
    starts = tf.concat([[True], tf.not_equal(rows[1:], rows[:-1])], 0)
    segments = tf.cumsum(tf.cast(starts, "int32")) - 1
    values = tf.math.unsorted_segment_sum(tf.gather(slices.values, order), segments, count)
    rows = tf.math.unsorted_segment_max(rows, segments, count)
    distinct = tf.range(count) <= tf.reduce_max(segments)
    return tf.where(distinct, rows, tf.zeros((), rows.dtype)), values


def zeros_like_state(value):
    """Zeros shaped like `value` (a variable or a tensor, NaN and Inf
    included), as `value * 0` with `multiply_no_nan`. Graph mode folds a
    `tf.zeros_like` of a known shape into a constant that lives as long as
    the compiled step, used or not (one more parameter-sized buffer held for
    good by a branch that zeroes the state); this is computed only where it
    runs."""
    value = tf.convert_to_tensor(value)
    return tf.math.multiply_no_nan(value, tf.zeros((), value.dtype))
