"""How the TensorFlow driver runs a rule: the one place that decides, and
the gradients it hands over (dense or sparse rows, the finite check).

The maths of each optimizer is written once (`keras_accum.folds`, and each
optimizer's window update) in terms of two conditions, `start` (the
micro-batch opens a window) and `ok` (its gradients are finite). A
condition is a Python bool or a boolean tensor, and `where(c, x, y)` picks
at trace time for a bool and selects elementwise for a tensor. This module
decides which the maths gets, and where it runs:

* `by_condition(fn, *conditions)`: under XLA `fn` runs once with the
  tensors (a select fuses into the pass that computes its operands, and XLA
  copies the state a `tf.cond` carries); in graph mode and eagerly `fn` runs
  in `tf.cond` branches with Python bools (a branch costs nothing there,
  a select a full pass over its operands).
* `run(kernel, owner, *args, jit=...)`: a fold over every variable as one
  XLA-compiled kernel from a graph-mode step (one launch that reads each
  operand once), or inline (under XLA, eagerly, or for a small model where
  the launch costs more than the passes it saves: `worth_compiling`).
* `at_window_end(boundary, end, every_step)`: the window's update in a
  `tf.cond` on the boundary; with one micro-batch per window on every step;
  under XLA on one replica on every micro-step with its writes kept only
  at the boundary (`keep_where`), since XLA copies every variable a `cond`
  branch writes on the N - 1 steps that skip it.
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
    """`x` where `condition` holds, else `y`: picked now for a Python bool,
    selected elementwise (`tf.where`) for a boolean tensor."""
    if condition is True:
        return x
    if condition is False:
        return y
    return tf.where(condition, x, y)


def by_condition(fn, *conditions):
    """`fn(*conditions)`, each condition a boolean tensor or None (always
    True). Under XLA `fn` gets the tensors; elsewhere it runs in nested
    `tf.cond` branches, each with Python bools."""
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
    """A variable's value through its resource handle (in a compiled
    kernel; in replica context the local replica's component)."""
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def write(handle, value):
    """`value` into a variable through its resource handle."""
    tf.raw_ops.AssignVariableOp(resource=handle, value=value)


# Below this many parameters (all the variables of one fold) the graph-mode
# fold runs inline as TensorFlow ops: there one more kernel launch costs
# more than the passes it saves (BENCHMARKS.md, "Graph-mode folds").
MIN_PARAMETERS = 65536


def worth_compiling(tensors):
    """True when `tensors` (or variables) hold MIN_PARAMETERS or more
    elements, or a shape is unknown while tracing."""
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
    """`kernel(*args)`: inline when executing eagerly, under XLA (it fuses
    into the caller's kernels) or when `jit` is False, else as one
    XLA-compiled `tf.function` built once per `owner`. Variables are passed
    as handles: in replica context a distributed variable's handle is the
    local replica's component, so one kernel serves every replica."""
    if tf.executing_eagerly() or in_xla() or not jit:
        return kernel(*args)
    kernels = _COMPILED.setdefault(owner, {})
    if kernel not in kernels:
        kernels[kernel] = tf.function(kernel, jit_compile=True, autograph=False)
    return kernels[kernel](*args)


def at_window_end(boundary, end, every_step):
    """Runs the window's update `end(keep)` where `boundary` holds.

    `every_step`: every micro-batch ends a window, `end(None)` runs
    directly. Under XLA on one replica `end(boundary)` runs on every
    micro-step and must keep its writes only where `boundary` holds (see
    `keep_where`). Elsewhere `end(None)` runs in a `tf.cond`.
    """
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
    """Writes to `variables` that hold only where `keep` (a boolean scalar
    tensor) is True; elsewhere each variable keeps its value from before.

    A select, `where(keep, new, old)`, fuses into the pass that computes
    `new` and writes the variable in place. The update's own writes of slots
    and variables go through `assign`, so that the rest of the update reads
    the kept value, as plain Adam reads its new moments: selecting only
    after the whole update would leave two readers of each old slot, and
    XLA copies a buffer that one pass reads while another overwrites it.
    """

    def __init__(self, keep, variables):
        self.keep = keep
        self._targets = list(variables)
        self._before = {_key(v): tf.identity(tf.convert_to_tensor(v)) for v in self._targets}
        self._selected = set()

    def assign(self, assign, variable, value, mode="assign"):
        """variable = where(keep, new, old), where new is `value` (mode
        "assign"), old + value ("assign_add") or old - value ("assign_sub")
        and old its value before the update; written with `assign(variable,
        tensor)`."""
        current = tf.convert_to_tensor(variable)
        value = tf.cast(tf.convert_to_tensor(value), current.dtype)
        new = {"assign": value, "assign_add": current + value, "assign_sub": current - value}[mode]
        old = self._before.get(_key(variable), current)
        assign(variable, tf.where(self.keep, new, old))
        self._selected.add(_key(variable))

    def restore(self, reselect=()):
        """Puts back the old value where `keep` is False in every variable
        not written by `assign` (and in those of `reselect`, which may have
        been written otherwise after it). An untouched variable becomes
        where(keep, x, x) = x, which XLA drops."""
        again = {_key(v) for v in reselect}
        for variable in self._targets:
            key = _key(variable)
            if key in self._selected and key not in again:
                continue
            variable.assign(tf.where(self.keep, tf.convert_to_tensor(variable), self._before[key]))

    def writer(self, optimizer):
        """What an update of `optimizer` writes its slots and variables with
        (`assign`, `assign_add`, `assign_sub`, as a Keras optimizer's
        methods), writing kept values: it is passed to the update."""
        return _KeptWriter(
            self, lambda variable, value: type(optimizer).assign(optimizer, variable, value)
        )

    def routing(self, optimizer):
        """Routes the `assign*` methods of a Keras optimizer that this
        library wraps (`GradientAccumulation`'s) through `assign` while the
        update runs (`_compat.routed_assigns`: its `update_step` takes no
        writer; a `tf.cond` around it instead copies ~5 parameter-sized
        buffers per micro-step under XLA)."""
        return _compat.routed_assigns(optimizer, self.writer(optimizer))


class _KeptWriter:
    """`assign`, `assign_add` and `assign_sub` that keep their writes only
    where `kept.keep` holds (see `KeptWrites.assign`)."""

    def __init__(self, kept, write):
        self._kept, self._write = kept, write

    def assign(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign")

    def assign_add(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign_add")

    def assign_sub(self, variable, value):
        self._kept.assign(self._write, variable, value, "assign_sub")


def keep_where(keep, trainable_variables, state, owner, update, wrapped=()):
    """Runs `update(writer)` and keeps its writes only where `keep` holds.

    `state`: every variable the update may write, `trainable_variables`
    included. `update` writes them directly or with `writer` (the kept
    `assign*` of `owner`, the optimizer), and `wrapped` optimizers with
    their own methods (routed while it runs).
    """
    kept = KeptWrites(keep, state)
    with contextlib.ExitStack() as stack:
        for optimizer in wrapped:
            stack.enter_context(kept.routing(optimizer))
        update(kept.writer(owner))
    # Written again after the update's `assign*`: by a constraint, or by an
    # EMA overwrite (all of them); the kept select must cover those again.
    again = [v for v in trainable_variables if v.constraint is not None]
    if any(o.use_ema and o.ema_overwrite_frequency for o in [owner, *wrapped]):
        again = trainable_variables
    kept.restore(reselect=again)


# -- gradients: dense or sparse (`tf.IndexedSlices`), zeros, the finite check --

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


# Gradients under this many elements are checked elementwise under XLA
# (see `all_finite`).
SMALL = 65536


def all_finite(grads):
    """True when no gradient holds a NaN or an Inf (exact).

    NaN and Inf propagate into a sum: one `reduce_sum` read per gradient,
    no boolean tensor; the elementwise test runs in a `cond` only if a
    float32 sum overflows. Under XLA that `cond` carries its operands and
    costs the most with many small ones, where the elementwise test fused
    into one pass is cheap: gradients under `SMALL` elements are tested
    elementwise there, the rest by their sums (BENCHMARKS.md, "Non-finite
    check")."""
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
    """Applies `optimizer.nonfinite` to one replica's gradients (replica
    context, no communication).

    Returns `(grads, ok)`: under a `skip_*` policy `ok` is a boolean scalar
    (the skip counted on `optimizer`) and, with `mask`, a non-finite
    micro-batch comes back as zeros (an arithmetic mask, no branch over
    parameter-sized state); else `ok` is None.
    """
    policy = optimizer._nonfinite_policy
    if not policy.screens:
        return grads, None
    if policy.raises:
        if in_xla():
            refuse_raise_under_xla(optimizer.name)
        # One check of the micro-batch, naming the optimizer and the
        # micro-step; what follows waits for it (nothing folds a NaN in).
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
