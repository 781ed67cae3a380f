"""How the TensorFlow driver runs a rule, decided here alone: a branch or a
select (`by_condition`, `at_window_end`: XLA copies the state a `tf.cond`
carries, so under XLA selects), one compiled kernel or inline (`run`); and
the gradients it hands over (dense or sparse rows, the finite check).
"""

import contextlib
import weakref

import keras

from keras_accum import _compat, _replicas, nonfinite
from keras_accum._backend import tf


def in_xla():
    """True while tracing for XLA (`jit_compile=True`)."""
    return _compat.in_xla()


def where(condition, x, y):
    """`x` where `condition` holds, else `y` (picked now for a bool)."""
    if condition is True:
        return x
    if condition is False:
        return y
    return tf.where(condition, x, y)


def by_condition(fn, *conditions):
    """`fn(*conditions)` (tensors or None: True): under XLA with the
    tensors, elsewhere in nested `tf.cond` branches with Python bools."""
    if in_xla():
        return fn(*[True if c is None else c for c in conditions])
    return _branch(fn, list(conditions), [])


def _branch(fn, conditions, known):
    if not conditions:
        return fn(*known)
    first, rest = conditions[0], conditions[1:]
    if first is None:
        return _branch(fn, rest, known + [True])
    tf.cond(
        first,
        lambda: _branch(fn, rest, known + [True]),
        lambda: _branch(fn, rest, known + [False]),
    )


def read(handle, dtype):
    """A variable's value through its resource handle."""
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def write(handle, value):
    """`value` into a variable through its resource handle."""
    tf.raw_ops.AssignVariableOp(resource=handle, value=value)


# Smaller folds run inline (BENCHMARKS.md, "Thresholds in the code").
MIN_PARAMETERS = 65536


def worth_compiling(tensors):
    """True from MIN_PARAMETERS elements in all, or for an unknown shape."""
    total = 0
    for tensor in tensors:
        count = tf.TensorShape(tensor.shape).num_elements()
        if count is None:
            return True
        total += count
    return total >= MIN_PARAMETERS


# Per owner (an optimizer): its traces go when it goes.
_COMPILED = weakref.WeakKeyDictionary()


def run(kernel, owner, *args, jit=True):
    """`kernel(*args)`: inline eagerly, under XLA or without `jit`, else one
    XLA-compiled `tf.function` per `owner`. Variables go as handles (the
    local replica's component): one kernel serves every replica."""
    if tf.executing_eagerly() or in_xla() or not jit:
        return kernel(*args)
    kernels = _COMPILED.setdefault(owner, {})
    if kernel not in kernels:
        kernels[kernel] = tf.function(kernel, jit_compile=True, autograph=False)
    return kernels[kernel](*args)


def at_window_end(boundary, end, every_step):
    """Runs `end(keep)` where `boundary` holds: directly (`every_step`),
    under XLA on one replica as `end(boundary)` every micro-step (writes
    kept, `keep_where`), else in a `tf.cond`."""
    if every_step:
        end(None)
    elif in_xla() and _replicas.count() == 1:
        end(boundary)
    else:
        tf.cond(boundary, lambda: end(None), lambda: None)


def _key(variable):
    """The `tf.Variable` behind a Keras variable (both are passed around)."""
    return id(variable.value if isinstance(variable, keras.Variable) else variable)


class KeptWrites:
    """Writes to `variables` kept only where `keep` holds (a select each).
    Selected at each `assign`, not after the update: two readers of an old
    slot would make XLA copy it."""

    def __init__(self, keep, variables):
        self.keep = keep
        self._targets = list(variables)
        self._before = {_key(v): tf.identity(tf.convert_to_tensor(v)) for v in self._targets}
        self._selected = set()

    def assign(self, assign, variable, value, mode="assign"):
        """variable = where(keep, new, old), new by `mode` from the current
        value, old the value before the update."""
        current = tf.convert_to_tensor(variable)
        value = tf.cast(tf.convert_to_tensor(value), current.dtype)
        new = {"assign": value, "assign_add": current + value, "assign_sub": current - value}[mode]
        old = self._before.get(_key(variable), current)
        assign(variable, tf.where(self.keep, new, old))
        self._selected.add(_key(variable))

    def restore(self, reselect=()):
        """Selects every variable not written by `assign`, and those of
        `reselect` (written again after it); XLA drops where(keep, x, x)."""
        again = {_key(v) for v in reselect}
        for variable in self._targets:
            key = _key(variable)
            if key in self._selected and key not in again:
                continue
            variable.assign(tf.where(self.keep, tf.convert_to_tensor(variable), self._before[key]))

    def writer(self, optimizer):
        """Kept `assign*` for an update of `optimizer`."""
        return _KeptWriter(
            self, lambda variable, value: type(optimizer).assign(optimizer, variable, value)
        )

    def routing(self, optimizer):
        """Routes a wrapped Keras optimizer's `assign*` through `assign`
        while the update runs (`_compat.routed_assigns`)."""
        return _compat.routed_assigns(optimizer, self.writer(optimizer))


class _KeptWriter:
    """`assign*` kept only where `kept.keep` holds."""

    def __init__(self, kept, write):
        self._kept, self._write = kept, write

    def assign(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign")

    def assign_add(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign_add")

    def assign_sub(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign_sub")


def keep_where(keep, trainable_variables, state, owner, update, wrapped=()):
    """Runs `update(writer)`, its writes to `state` (all it may write) kept
    only where `keep` holds; `wrapped` optimizers' writes routed."""
    kept = KeptWrites(keep, state)
    with contextlib.ExitStack() as stack:
        for optimizer in wrapped:
            stack.enter_context(kept.routing(optimizer))
        update(kept.writer(owner))
    # Constraints and an EMA overwrite write again after `assign*`.
    again = [v for v in trainable_variables if v.constraint is not None]
    if any(o.use_ema and o.ema_overwrite_frequency for o in [owner, *wrapped]):
        again = trainable_variables
    kept.restore(reselect=again)


# -- gradients: dense or sparse (`tf.IndexedSlices`), zeros, the finite check --

# Sparse gradients of smaller variables are made dense (BENCHMARKS.md).
SPARSE_MIN_ELEMENTS = 65536


def dense(grad):
    """Gradients as dense tensors (an Embedding gives `tf.IndexedSlices`)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def values_of(grad):
    """`grad`, or the rows of a `tf.IndexedSlices`."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def map_values(fn, grad):
    """`grad` with `fn` applied to its numbers (`values_of`), kept sparse."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def sparse_or_dense(grad, variable):
    """`grad` kept sparse from `SPARSE_MIN_ELEMENTS`, else dense."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    count = tf.TensorShape(variable.shape).num_elements()
    if count is not None and count >= SPARSE_MIN_ELEMENTS:
        return grad
    return dense(grad)


def combine_rows(slices):
    """(rows, values) with repeated rows summed. Static shapes for XLA:
    the rows beyond the distinct ones are row 0 with zero values."""
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
    """Zeros like `value` (NaN and Inf too), as `multiply_no_nan(x, 0)`:
    graph mode folds `tf.zeros_like` into a held constant (PITFALLS.md, 22)."""
    value = tf.convert_to_tensor(value)
    return tf.math.multiply_no_nan(value, tf.zeros((), value.dtype))


# Under XLA smaller gradients are checked elementwise (`all_finite`).
SMALL = 65536


def all_finite(grads):
    """True when no gradient holds a NaN or an Inf (exact): by sums, the
    elementwise test in a `cond` only if one overflows; under XLA those
    under `SMALL` elements elementwise (BENCHMARKS.md)."""
    grads = [values_of(g) for g in grads]
    if not grads:
        return tf.constant(True)
    small, large = [], list(grads)
    if in_xla():
        small = [g for g in grads if _elements(g) < SMALL]
        large = [g for g in grads if _elements(g) >= SMALL]
    checks = [_elementwise_finite(small)] if small else []
    if large:
        sums = tf.stack([tf.reduce_sum(tf.cast(g, "float32")) for g in large])
        checks.append(
            tf.cond(
                tf.reduce_all(tf.math.is_finite(sums)),
                lambda: tf.constant(True),
                lambda: _elementwise_finite(large),
            )
        )
    return checks[0] if len(checks) == 1 else checks[0] & checks[1]


def _elementwise_finite(tensors):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


def _elements(tensor):
    count = tf.TensorShape(tensor.shape).num_elements()
    return SMALL if count is None else count


def refuse_raise_under_xla(name):
    """ValueError: XLA drops `check_numerics`, so "raise" cannot raise."""
    raise ValueError(
        f"{name}: `nonfinite='raise'` cannot raise in XLA-compiled code, where "
        "TensorFlow drops the check; use 'skip_micro_batch', 'skip_window' or "
        "None, or compile without XLA. Received: nonfinite='raise' with "
        "jit_compile=True"
    )


def screen(optimizer, grads, mask=True):
    """`optimizer.nonfinite` on one replica's gradients: `(grads, ok)`, `ok`
    a counted boolean under `skip_*` (else None); with `mask` a bad
    micro-batch as zeros."""
    policy = optimizer._nonfinite_policy
    if not policy.screens:
        return grads, None
    if policy.raises:
        if in_xla():
            refuse_raise_under_xla(optimizer.name)
        # What follows waits for the check: nothing folds a NaN in.
        message = f"{optimizer.name}: {nonfinite.MESSAGE} at micro-step"
        check = tf.debugging.Assert(
            all_finite(grads), [message, optimizer._window.micro_step + 1], summarize=1
        )
        with tf.control_dependencies([check]):
            return [map_values(tf.identity, g) for g in grads], None
    ok = all_finite(grads)
    bad = 1 - tf.cast(ok, "int64")
    optimizer._window.skipped_micro_batches.assign_add(bad)
    if policy.drops_windows:
        optimizer._window.bad.assign_add(bad)
    if not mask:
        return grads, ok
    # g, or a broadcast scalar zero for a skipped micro-batch.
    keep = lambda x: tf.where(ok, x, tf.zeros((), x.dtype))
    return [map_values(keep, g) for g in grads], ok
