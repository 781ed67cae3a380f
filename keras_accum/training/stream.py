"""The resumable data stream: global batches, replayed to a position
(batches trained plus end-of-epoch markers passed) by reading and discarding
them. See docs/guides/custom_loop.md.
"""

import tensorflow as tf

from keras_accum.training.distribute import data_sharded


def split_batch(batch):
    """(x, y, sample_weight or None) from a dataset element."""
    if not isinstance(batch, tuple) or len(batch) not in (2, 3):
        raise ValueError(
            "`dataset` elements must be tuples (x, y) or (x, y, "
            f"sample_weight). Received element: {batch!r}"
        )
    return batch if len(batch) == 3 else (*batch, None)


def batch_size(batch):
    return tf.shape(tf.nest.flatten(batch)[0])[0]


def peek_batch_size(dataset):
    """Size of the first batch of `dataset` (the global batch size).

    Args:
        dataset: a `tf.data.Dataset` of global batches.

    Returns:
        The first batch's size, as a Python int.

    Raises:
        ValueError: `dataset` is not a finite, non-empty `tf.data.Dataset`.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "`dataset` must be a `tf.data.Dataset` of global batches. "
            f"Received: dataset={dataset!r}"
        )
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` must be finite (one epoch); the loop repeats it "
            f"`epochs` times. Received: dataset={dataset!r}"
        )
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise ValueError(f"`dataset` is empty. Received: dataset={dataset!r}")
    return int(batch_size(split_batch(first)))


def _end_marker(dataset):
    """A one-element dataset holding an empty batch shaped like `dataset`'s."""

    def empty(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
            raise ValueError(
                "`dataset` elements must be dense tensors of known rank. "
                f"Received: element_spec={dataset.element_spec!r}"
            )
        shape = [0] + [d or 0 for d in spec.shape[1:]]
        if spec.dtype == tf.string:
            return tf.fill(shape, "")
        return tf.zeros(shape, spec.dtype)

    return tf.data.Dataset.from_tensors(tf.nest.map_structure(empty, dataset.element_spec))


def replay(dataset, strategy, *, position, epochs, full_batch=None):
    """`epochs` passes over `dataset`, distributed, an end marker after each,
    from `position` on; empty batches (and sizes other than `full_batch`) dropped."""
    dataset = dataset.filter(lambda *b: batch_size(b) > 0)
    if full_batch is not None:
        dataset = dataset.filter(lambda *b: batch_size(b) == full_batch)
    stream = dataset.concatenate(_end_marker(dataset)).repeat(epochs)
    return strategy.experimental_distribute_dataset(data_sharded(stream.skip(position)))
