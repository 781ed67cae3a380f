"""Every `tf.distribute` call of the optimizers: verbs that work alike on
one device and under (MultiWorker)MirroredStrategy, and replica-local
(sync-on-read, SUM) state.
"""

import contextlib

import keras
from keras import initializers

from keras_accum import _backend, _compat
from keras_accum._backend import tf


def strategy():
    """The strategy in scope (the default one on one device)."""
    return tf.distribute.get_strategy()


def count():
    """Replicas in sync, in either context."""
    context = tf.distribute.get_replica_context()
    if context is not None:
        return context.num_replicas_in_sync
    return strategy().num_replicas_in_sync


def count_at_build(optimizer):
    """Replicas of `optimizer`'s strategy (1 under JAX and PyTorch)."""
    if not _backend.IS_TENSORFLOW:
        return 1
    return _compat.optimizer_strategy(optimizer).num_replicas_in_sync


def is_first_replica():
    """Replica context: a boolean tensor, True on replica 0."""
    return tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)


def merge(fn, *args):
    """Replica context -> `fn(*args)` once, cross-replica (`merge_call`)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError("must be called in a replica context (inside `strategy.run`)")
    return context.merge_call(lambda _, *a: fn(*a), args=args)


def for_each_replica(fn, *args):
    """Cross-replica -> `fn(*args)` on each replica; per-replica results."""
    return strategy().extended.call_for_each_replica(fn, args=args)


def update_each(variables, fn, *args):
    """`fn(variable, *args)` on each copy of each variable (cross-replica)."""
    extended = strategy().extended
    for variable in variables:
        extended.update(getattr(variable, "value", variable), fn, args=args, group=False)


def sum_over_replicas(pairs):
    """Sums of (per-replica value, variable) pairs, each placed with its
    variable: one batched all-reduce."""
    if not pairs:
        return []
    pairs = [(value, getattr(variable, "value", variable)) for value, variable in pairs]
    return strategy().extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)


def sum_scalars(value):
    """Cross-replica sum of a per-replica tensor (a small one), on the host."""
    return strategy().reduce(tf.distribute.ReduceOp.SUM, value, axis=None)


def local_value(value):
    """The first local component of a distributed value."""
    return strategy().experimental_local_results(value)[0]


def is_per_replica(value):
    return isinstance(value, tf.distribute.DistributedValues)


def _sync_on_read(next_creator, **kwargs):
    """A variable creator making sync-on-read, SUM variables (Keras < 3.10
    takes no `synchronization=`; checked 3.8.0-3.15.1)."""
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.SUM
    return next_creator(**kwargs)


def sync_on_read():
    """A context whose new `keras.Variable`s are replica-local."""
    return tf.variable_creator_scope(_sync_on_read)


def replica_scalar(initial, name):
    """A replica-local float32 `tf.Variable`, saved by no one."""
    return tf.Variable(
        initial,
        trainable=False,
        dtype="float32",
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
        name=name,
    )


def read_local(variable):
    """Replica context: a copy of this replica's value."""
    return tf.identity(variable.read_value())


def slot_name(reference, name):
    """A slot's name, as Keras's ("dense_kernel_momentum")."""
    prefix = getattr(reference, "path", reference.name)
    return f"{prefix.replace('/', '_').replace(':', '_')}_{name}"


def add_local_variable(optimizer, shape, dtype, name, reference=None):
    """A replica-local variable of `optimizer` (read: the sum; a
    cross-replica assign: split evenly), named and placed after `reference`."""
    colocate = contextlib.nullcontext()
    if reference is not None:
        name = slot_name(reference, name)
    if not _backend.IS_TENSORFLOW:  # one device's worth of state
        # Its reference's layout, else `keras.distribution` replicates it.
        layout = None if reference is None else _compat.variable_layout(reference)
        with keras.name_scope(optimizer.name, caller=optimizer):
            variable = keras.Variable(
                initializer=initializers.get("zeros"),
                shape=shape,
                dtype=dtype,
                trainable=False,
                name=name,
                **({} if layout is None else {"layout": layout}),
            )
        _compat.track_variable(optimizer, variable)
        return variable
    if reference is not None:
        colocate = _compat.optimizer_strategy(optimizer).extended.colocate_vars_with(
            getattr(reference, "value", reference)
        )
    with (
        colocate,
        keras.name_scope(optimizer.name, caller=optimizer),
        sync_on_read(),
    ):
        variable = keras.Variable(
            initializer=initializers.get("zeros"),
            shape=shape,
            dtype=dtype,
            trainable=False,
            aggregation="sum",
            name=name,
        )
    _compat.track_variable(optimizer, variable)
    return variable


def read_total(variable):
    """Cross-replica: a replica-local variable's total (a reduction)."""
    return tf.convert_to_tensor(variable.value)


def assign_total(variable, value):
    """Cross-replica: each replica gets value / replicas (no read-back)."""
    variable.value.assign(tf.cast(value, variable.dtype), read_value=False)


def scatter_add(variable, slices):
    """variable[indices] += values, repeated rows summed, through the
    handle (the local component; a replica-local one has no scatter_add)."""
    tf.raw_ops.ResourceScatterAdd(
        resource=variable.handle, indices=slices.indices, updates=slices.values
    )
