"""Everything the optimizers do across replicas, in one place.

The optimizers' files make no `tf.distribute` call: the base class enters
cross-replica context (`merge_call`, in `AccumulationOptimizer.apply`) and
the hooks it calls use these verbs, which work the same on one device and
under `MirroredStrategy` / `MultiWorkerMirroredStrategy`:

* `for_each_replica(fn, *args)`: cross-replica -> each replica runs `fn`
  on its own share of per-replica `args`;
* `update_each(variables, fn, *args)`: `fn(variable, *args)` on every copy
  of each (mirrored) variable;
* `sum_over_replicas(pairs)`: one batched all-reduce (SUM) of
  (per-replica value, destination variable) pairs;
* `add_local_variable`, `read_total`, `assign_total`, `scatter_add`:
  replica-local (sync-on-read) state, each replica holding its own part.
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
    """Replicas of the strategy `optimizer` was created under (1 under
    JAX and PyTorch, whose data parallelism hands it global gradients)."""
    if not _backend.IS_TENSORFLOW:
        return 1
    return _compat.optimizer_strategy(optimizer).num_replicas_in_sync


def is_first_replica():
    """Replica context: a boolean tensor, True on replica 0."""
    return tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)


def merge(fn, *args):
    """Replica context -> `fn(*args)` once, in cross-replica context (its
    arguments become per-replica values). The one sync point of `apply`."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError("must be called in a replica context (inside `strategy.run`)")
    return context.merge_call(lambda _, *a: fn(*a), args=args)


def for_each_replica(fn, *args):
    """Cross-replica context -> `fn(*args)` on each replica (replica
    context), per-replica arguments unwrapped. Returns per-replica values."""
    return strategy().extended.call_for_each_replica(fn, args=args)


def update_each(variables, fn, *args):
    """`fn(variable, *args)` for each variable, on each of its copies
    (cross-replica context); mirrored `args` are unwrapped per copy."""
    extended = strategy().extended
    for variable in variables:
        extended.update(getattr(variable, "value", variable), fn, args=args, group=False)


def sum_over_replicas(pairs):
    """[sum over replicas of value] for (per-replica value, variable) pairs,
    each total placed with its variable: one batched all-reduce."""
    if not pairs:
        return []
    pairs = [(value, getattr(variable, "value", variable)) for value, variable in pairs]
    return strategy().extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)


def sum_scalars(value):
    """Cross-replica sum of a per-replica tensor (a small one), on the host."""
    return strategy().reduce(tf.distribute.ReduceOp.SUM, value, axis=None)


def local_value(value):
    """The first local replica's component of a distributed value (a value
    every replica holds alike), or `value` itself."""
    return strategy().experimental_local_results(value)[0]


def is_per_replica(value):
    return isinstance(value, tf.distribute.DistributedValues)


def _sync_on_read(next_creator, **kwargs):
    """A `tf.variable_creator_scope` creator: the `tf.Variable` inside a
    `keras.Variable` becomes sync-on-read, SUM. Through TensorFlow because
    `keras.Variable` takes `synchronization=` only from Keras 3.10 on; this
    way is the same on every Keras version (3.8.0-3.15.1 checked)."""
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.SUM
    return next_creator(**kwargs)


def sync_on_read():
    """A context in which each `keras.Variable` created is replica-local
    (sync-on-read, SUM): each replica holds its own part, a read in
    cross-replica context (or a save) sees the total."""
    return tf.variable_creator_scope(_sync_on_read)


def replica_scalar(initial, name):
    """A float32 `tf.Variable` of one value per replica (sync-on-read,
    SUM), tracked and saved by no one: `weigh_micro_batches`'s item count."""
    return tf.Variable(
        initial,
        trainable=False,
        dtype="float32",
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
        name=name,
    )


def read_local(variable):
    """Replica context: this replica's value of a replica-local variable
    (a copy: the variable may be written next)."""
    return tf.identity(variable.read_value())


def slot_name(reference, name):
    """A slot's name after its model variable, as Keras's
    `add_variable_from_reference` names it ("dense_kernel_momentum")."""
    prefix = getattr(reference, "path", reference.name)
    return f"{prefix.replace('/', '_').replace(':', '_')}_{name}"


def add_local_variable(optimizer, shape, dtype, name, reference=None):
    """A replica-local variable of `optimizer`: each replica holds its own
    part, a read in cross-replica context (or a checkpoint) sees the sum,
    and a cross-replica assign splits the value evenly over the replicas.
    With `reference` (a model variable) it is named after it and placed
    with it: colocated under `tf.distribute`, sharded as it is under
    `keras.distribution` (JAX)."""
    colocate = contextlib.nullcontext()
    if reference is not None:
        name = slot_name(reference, name)
    if not _backend.IS_TENSORFLOW:  # one device's worth of state
        # Under `keras.distribution` it takes its reference's layout, as a
        # slot of `add_variable_from_reference` does (without, the
        # distribution would replicate it: its path is in no LayoutMap).
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
    """Value of a replica-local variable summed over replicas. Called in
    cross-replica context, where reading such a variable performs the
    reduction."""
    return tf.convert_to_tensor(variable.value)


def assign_total(variable, value):
    """Cross-replica assign to a replica-local variable: each replica gets
    value / replicas. No read-back (that would be one more reduction)."""
    variable.value.assign(tf.cast(value, variable.dtype), read_value=False)


def scatter_add(variable, slices):
    """variable[slices.indices] += slices.values, repeated rows summed: a
    write of the rows seen, not of the whole variable. Through the variable's
    handle, which in replica context is the local replica's component (a
    replica-local variable has no `scatter_add` of its own)."""
    tf.raw_ops.ResourceScatterAdd(
        resource=variable.handle, indices=slices.indices, updates=slices.values
    )
