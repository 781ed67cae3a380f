"""Shared machinery of the keras_accum optimizers.

Every keras_accum optimizer sees one *micro-batch* gradient per `apply` call
and changes the model's variables once per *window* of `steps` calls. Under a
`tf.distribute` strategy each call carries one micro-batch per replica, so a
window holds `kappa = steps * num_replicas_in_sync` micro-batches.

How a call is processed (TensorFlow backend):

1. `apply` runs in replica context, as Keras's `train_step` and a custom
   `strategy.run` loop call it. It immediately enters cross-replica context
   with `merge_call`, so that the window boundary is decided there. A `cond`
   whose branch needs a sync point cannot live in replica context (the crash
   of Keras's own `gradient_accumulation_steps` under MirroredStrategy,
   keras-team/keras#20582); Keras's `LossScaleOptimizer` does the same.
2. `_accumulate` (subclass) folds the micro-batch into the optimizer state,
   replica-locally where the algorithm allows it (no communication).
3. The micro-step counter advances; at a boundary `_update` (subclass)
   changes the model variables and `iterations` (the update count, which
   learning-rate schedules see) advances by one. In graph mode the boundary
   is a `tf.cond`; under XLA on one replica the update runs on every
   micro-step and a select keeps it only at the boundary, since XLA copies
   whatever a `cond` writes on every step that skips it
   (`keras_accum.kept_writes`).

Incoming gradients follow the Keras convention: each replica's gradient is
its share of the global mean, i.e. the gradient of the replica's summed loss
divided by the *global* number of items (what `model.fit` produces); summed
over replicas it is the gradient of the global micro-batch mean.

Non-finite gradients are governed by `nonfinite`:

* `"skip_micro_batch"` (the default of `InvariantAdam` and
  `UpdateAccumulationAdam`): a micro-batch with a NaN or Inf gradient on a
  replica is left out of the window (masked to zero with no weight, no
  branch); `skipped_micro_batches` counts it. Window state is reset at the
  window's start whatever its first micro-batch does, so a skip never leaves
  the previous window's sums or update in place. Costs one read of every
  gradient per micro-batch.
* `"skip_window"` (the default of `GradientAccumulation`): the update of the
  window containing it is dropped and `skipped_updates` counts it: the
  parameters do not move (moments already updated by earlier micro-batches
  keep them, see `UpdateAccumulationAdam`; `InvariantAdam` refuses it).
  `GradientAccumulation` checks its window sums once, at the window's end
  (NaN and Inf propagate into a sum), not every micro-batch: it is what
  the big batch the window stands for would do.
* `"raise"`: `tf.errors.InvalidArgumentError` at the first non-finite value.
  Not under XLA (`jit_compile=True`, Keras's default on a GPU), which drops
  the check: there the step is refused with a one-line ValueError when it
  is traced.
* `None`: no check (fastest; a NaN then propagates as in plain Keras).

State, field by field (creation order is the checkpoint format):
`iterations` (updates applied), `micro_step` (calls to `apply`),
`skipped_micro_batches` (per replica, summed on read), `skipped_updates`
(windows whose update was dropped), `window_bad` (non-finite micro-batches
in the current window, for `"skip_window"`), then each subclass's slots.
"""

import collections
import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import initializers, optimizers
from tensorflow.python.ops import control_flow_util

from keras_accum import kept_writes, schedules
from keras_accum.validation import check_choice, check_float

NONFINITE_POLICIES = ("skip_micro_batch", "skip_window", "raise", None)

# `apply(weight=ReplicaItems(n))`: n items (or tokens: the loss denominator)
# on this replica, gradients in the model.fit convention (this replica's mean
# gradient / replicas). Set by `weigh_micro_batches`.
ReplicaItems = collections.namedtuple("ReplicaItems", ["items"])


def all_finite(grads):
    """True when no gradient holds a NaN or an Inf (exact).

    NaN and Inf propagate into a sum: one `reduce_sum` read per gradient,
    no boolean tensor; the elementwise test runs in a `cond` only if a
    float32 sum overflows. Under XLA that `cond` carries its operands and
    costs the most with many small ones, where the elementwise test fused
    into one pass is cheap: gradients under `SMALL` elements are tested
    elementwise there, the rest by their sums. (Side by side, XLA: the
    transformer, 38 gradients of at most 16,384 elements, 6-32% faster per
    micro-step in three runs than with sums for all; the MLP, with two
    1024 x 2048 kernels, 5-10% slower with the elementwise test for all.)"""
    grads = [values_of(g) for g in grads]
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


# Gradients under this many elements are checked elementwise under XLA.
SMALL = 65536


def _elements(tensor):
    count = tf.TensorShape(tensor.shape).num_elements()
    return SMALL if count is None else count


def in_xla():
    """True while tracing for XLA (`jit_compile=True`): there masks fuse
    into one pass and a `tf.cond` copies the state it carries; in graph
    mode a mask is a full pass and a `cond` is free."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def zeros_like_state(value):
    """Zeros shaped like `value` (a variable or a tensor, NaN and Inf
    included), as `value * 0` with `multiply_no_nan`. Graph mode folds a
    `tf.zeros_like` of a known shape into a constant that lives as long as
    the compiled step, used or not: one more parameter-sized buffer held for
    good by a branch that zeroes the state (measured: 16 MB on a 4.2M
    parameter MLP). This is computed only where it runs."""
    value = tf.convert_to_tensor(value)
    return tf.math.multiply_no_nan(value, tf.zeros((), value.dtype))


def dense(grad):
    """Gradients as dense tensors (an Embedding gives `tf.IndexedSlices`)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def values_of(grad):
    """The tensor holding a gradient's numbers: `grad` itself, or the rows
    of a `tf.IndexedSlices` (an Embedding's gradient: only the rows of the
    tokens seen, possibly repeated)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def map_values(fn, grad):
    """`grad` with `fn` applied to its numbers (`values_of`), kept sparse."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


# A sparse gradient of a variable with fewer elements than this is made
# dense: the sparse fold's few extra ops (a scatter; in InvariantAdam a sort
# and a segment sum) cost more there than the pass over the variable they
# save. (The 86k-parameter transformer's Embedding has 16,384.)
SPARSE_MIN_ELEMENTS = 65536


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


def scatter_add(variable, slices):
    """variable[slices.indices] += slices.values, repeated rows summed: a
    write of the rows seen, not of the whole variable. Through the variable's
    handle, which in replica context is the local replica's component (a
    replica-local variable has no `scatter_add` of its own)."""
    tf.raw_ops.ResourceScatterAdd(
        resource=variable.handle, indices=slices.indices, updates=slices.values
    )


def read_total(variable):
    """Value of a replica-local (sync-on-read) variable summed over replicas.

    Called in cross-replica context, where reading such a variable performs
    the reduction: this is the single communication of a window.
    """
    return tf.convert_to_tensor(variable.value)


def assign_total(variable, value):
    """Cross-replica assign to a replica-local variable: each replica gets
    value / replicas. No read-back (that would be one more reduction)."""
    variable.value.assign(tf.cast(value, variable.dtype), read_value=False)


def check_weight(weight):
    """`apply(weight=...)`: None (1), a number > 0 or a scalar tensor (its
    value checked when eager), or `ReplicaItems`."""
    if weight is None:
        return 1.0
    if isinstance(weight, ReplicaItems):
        return weight
    error = f"`weight` must be a scalar number > 0. Received: weight={weight!r}"
    if isinstance(weight, bool):
        raise ValueError(error)
    if isinstance(weight, (int, float, np.number)):
        return check_float("weight", weight, minimum=0.0, open_minimum=True)
    if isinstance(weight, np.ndarray):
        if weight.shape != ():
            raise ValueError(error)
        return check_float("weight", float(weight), minimum=0.0, open_minimum=True)
    shape = getattr(weight, "shape", None)
    if shape is None or tf.TensorShape(shape).rank not in (0, None):
        raise ValueError(error)
    if not tf.is_symbolic_tensor(weight) and hasattr(weight, "numpy"):
        if not float(weight.numpy()) > 0:
            raise ValueError(error)
    return weight


class AccumulationOptimizer(schedules.WindowMixin, optimizers.Optimizer):
    """Base class: one micro-batch per `apply`, one update per window."""

    # True when "skip_window" checks the window's state at its end instead
    # of counting non-finite micro-batches in `window_bad`.
    _checks_window_sums = False

    def __init__(self, learning_rate, steps=1, nonfinite="skip_micro_batch", **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.steps = schedules.check_steps(steps)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)

    def build(self, var_list):
        # What a saved, never-built instance holds (see `load_own_variables`).
        self._unbuilt_count = len(self.variables)
        super().build(var_list)
        self._micro_step = self.add_variable(
            (),
            dtype="int64",
            aggregation="only_first_replica",
            name="micro_step",
        )
        self._skipped_micro_batches = self.add_local_variable(
            (), dtype="int64", name="skipped_micro_batches"
        )
        self._skipped_updates = self.add_variable(
            (),
            dtype="int64",
            aggregation="only_first_replica",
            name="skipped_updates",
        )
        self._window_bad = self.add_local_variable((), dtype="int64", name="window_bad")
        self._build_window()

    def add_local_variable(self, shape, dtype, name, reference=None):
        """A replica-local variable: each replica holds its own part and a
        read in cross-replica context (or a checkpoint) sees the sum; a
        cross-replica assign splits the value evenly over the replicas."""
        colocate = contextlib.nullcontext()
        if reference is not None:
            prefix = getattr(reference, "path", reference.name)
            name = f"{prefix.replace('/', '_').replace(':', '_')}_{name}"
            colocate = self._distribution_strategy.extended.colocate_vars_with(
                getattr(reference, "value", reference)
            )
        with colocate, keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer=initializers.get("zeros"),
                shape=shape,
                dtype=dtype,
                trainable=False,
                aggregation="sum",
                synchronization="on_read",
                name=name,
            )
        self._track_variable(variable)
        return variable

    def get_weights(self):
        """Values of `variables`: the whole state, a wrapped optimizer's too."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights):
        """Sets every variable of `variables` (for `GradientAccumulation`
        the inner optimizer's too), in the order `get_weights` returns."""
        if not self.built:
            raise ValueError("Build the optimizer before calling `set_weights()`.")
        if len(weights) != len(self.variables):
            raise ValueError(
                f"`weights` must hold {len(self.variables)} arrays. "
                f"Received: len(weights)={len(weights)}"
            )
        for variable, weight in zip(self.variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape "
                    f"{tuple(variable.shape)}. Received: weight shape "
                    f"{tuple(np.shape(weight))}"
                )
            variable.assign(weight)

    # -- counters -----------------------------------------------------------

    # Before the optimizer is built (its first `apply`, or `build`) the
    # counters read 0, as Keras's `iterations` does.

    @property
    def micro_step(self):
        """Number of `apply` calls so far (micro-batches per replica)."""
        return self._counter("_micro_step")

    @property
    def skipped_micro_batches(self):
        return self._counter("_skipped_micro_batches")

    @property
    def skipped_updates(self):
        return self._counter("_skipped_updates")

    def _counter(self, name):
        counter = getattr(self, name, None)
        return tf.constant(0, "int64") if counter is None else counter

    def has_updated(self):
        """True when the last `apply` call ended a window (an update was
        applied, or dropped under a `skip_*` policy and counted)."""
        if not self.built:
            return tf.constant(False)
        step = self._micro_step
        return tf.logical_and(step > 0, self._window_done(step))

    # -- the step -----------------------------------------------------------

    def apply_gradients(self, grads_and_vars, weight=None):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight)
        return self.iterations

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        weight: Any = None,
    ) -> None:
        """Folds one micro-batch in; updates the variables at a boundary.

        Args:
            grads: gradients, one per trainable variable (Keras convention
                under a strategy, see the module docstring).
            trainable_variables: the variables; required on the first call.
            weight: optional number of items (or tokens) in the global
                micro-batch these gradients average over, a number > 0 or a
                scalar tensor. Only `GradientAccumulation` uses it: the window
                mean is then weighted by item counts, exact for unequal
                micro-batches.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`trainable_variables` must be given on the first call "
                    "to `apply`, or the optimizer built beforehand."
                )
            trainable_variables = self._trainable_variables
        grads, trainable_variables = list(grads), list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"`grads` must hold one gradient per variable "
                f"({len(trainable_variables)} variables). "
                f"Received: len(grads)={len(grads)}"
            )
        weight = check_weight(weight)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise ValueError(
                f"{self.__class__.__name__}.apply() must be called in a "
                "replica context (inside `strategy.run`), not in "
                "cross-replica context."
            )
        # Variables Keras overwrites with their gradient (float8 scales) take
        # no part in the window, as in `keras.optimizers.Optimizer.apply`.
        overwrite = [p for p in pairs if getattr(p[1], "overwrite_with_gradient", False)]
        pairs = [p for p in pairs if not getattr(p[1], "overwrite_with_gradient", False)]
        grads = [g for g, _ in pairs]
        if self.loss_scale_factor is not None:
            # g = g / loss_scale_factor, before anything else sees it.
            unscale = lambda x: x / self.loss_scale_factor
            grads = [map_values(unscale, g) for g in grads]
        args = (grads, [v for _, v in pairs], weight, overwrite)
        with keras.name_scope(self.name, caller=self):
            replica_context.merge_call(self._merge_apply, args=args)

    def _merge_apply(self, distribution, grads, trainable_variables, weight, overwrite):
        # Cross-replica context from here on: `grads` are per-replica values.
        window_start = self._start_window()
        if grads:
            self._accumulate(distribution, grads, trainable_variables, weight, window_start)
        micro_step = self._micro_step.assign_add(1)
        boundary = self._window_done(micro_step)
        self._overwrite_with_gradients(distribution, overwrite, boundary)
        if self.steps == 1:
            self._end_window(distribution, trainable_variables)
        elif in_xla() and distribution.num_replicas_in_sync == 1:
            # XLA copies every variable a `cond` branch writes on the steps
            # that skip it: compute the update every micro-step instead and
            # keep it only at the boundary (one fused pass, no copy).
            self._end_window(distribution, trainable_variables, boundary)
        else:
            tf.cond(
                boundary,
                lambda: self._end_window(distribution, trainable_variables),
                lambda: None,
            )

    def _overwrite_with_gradients(self, distribution, pairs, boundary):
        """`overwrite_with_gradient` variables take the gradient of the
        window's last micro-batch at the boundary (scalars, no cond)."""
        for grad, variable in pairs:

            def overwrite(var, grad):
                grad = tf.cast(dense(grad), var.dtype)
                var.assign(grad if self.steps == 1 else tf.where(boundary, grad, var))

            distribution.extended.update(variable.value, overwrite, args=(grad,), group=False)

    def _end_window(self, distribution, trainable_variables, boundary=None):
        """The window's update (or its drop). With `boundary` (a boolean
        tensor, under XLA on one replica) it runs on every micro-step and
        its writes are kept only where `boundary` holds (`kept_writes`)."""
        window = self._read_window(distribution, trainable_variables)

        def update():
            self._update(distribution, trainable_variables, window)
            self._finish_update(distribution, trainable_variables)
            self._iterations.assign_add(1)

        def drop():
            self._skipped_updates.assign_add(1)
            self._drop_window(distribution, trainable_variables)

        window_ok = self._window_ok(window)
        counts_bad = self.nonfinite == "skip_window" and not self._checks_window_sums
        if counts_bad:
            clean = tf.equal(read_total(self._window_bad), 0)
            window_ok = clean if window_ok is None else window_ok & clean
        if boundary is not None:
            keep = boundary if window_ok is None else boundary & window_ok
            state = list(trainable_variables) + list(self.variables)
            optimizers = self._updating_optimizers()
            kept_writes.keep_where(keep, trainable_variables, state, optimizers, update)
            if window_ok is not None:
                dropped = boundary & tf.logical_not(window_ok)
                self._skipped_updates.assign_add(tf.cast(dropped, "int64"))
                self._drop_window(distribution, trainable_variables, dropped)
        elif window_ok is None:
            update()
        else:
            tf.cond(window_ok, update, drop)
        if counts_bad:
            restart = 0
            if boundary is not None:  # window_bad = 0 at the window's end
                bad = read_total(self._window_bad)
                restart = tf.where(boundary, tf.zeros_like(bad), bad)
            assign_total(self._window_bad, restart)

    def _updating_optimizers(self):
        """The optimizers whose `assign*` the update calls."""
        return [self]

    def _drop_window(self, distribution, variables, dropped=None):
        """After a dropped update (where `dropped` holds, under XLA): leave
        no non-finite window state behind. Nothing by default."""
        return None  # a docstring-only body makes AutoGraph warn when traced

    def _finish_update(self, distribution, variables):
        """After an update, in Keras's order: EMA of the weights (and its
        periodic overwrite), then each variable's constraint."""
        if self.use_ema:
            self._update_model_variables_moving_average(self._trainable_variables)
            if self.ema_overwrite_frequency:
                tf.cond(
                    tf.equal((self._iterations + 1) % self.ema_overwrite_frequency, 0),
                    lambda: self._overwrite_model_variables_with_average_value(
                        self._trainable_variables
                    ),
                    lambda: None,
                )
        for variable in variables:
            if variable.constraint is not None:

                def constrain(var, constraint=variable.constraint):
                    var.assign(constraint(var))

                distribution.extended.update(variable.value, constrain, group=False)

    def _screen(self, grads, mask=True):
        """Applies the non-finite policy to one replica's dense gradients.

        Returns `(grads, ok)`: under a `skip_*` policy `ok` is a boolean
        scalar and, with `mask`, a non-finite micro-batch comes back as zeros
        (an arithmetic mask, no branch over parameter-sized state), else None.
        Replica context, no communication.
        """
        if self.nonfinite is None:
            return grads, None
        if self.nonfinite == "raise":
            if in_xla():
                # XLA drops `check_numerics`: the run would go on with NaN.
                raise ValueError(
                    f"{self.name}: `nonfinite='raise'` cannot raise in XLA-compiled "
                    "code, where TensorFlow drops the check; use 'skip_micro_batch', "
                    "'skip_window' or None, or compile without XLA. Received: "
                    "nonfinite='raise' with jit_compile=True"
                )
            message = f"{self.name}: non-finite gradient (nonfinite='raise')"
            check = lambda x: tf.debugging.check_numerics(x, message)
            return [map_values(check, g) for g in grads], None
        ok = all_finite(grads)
        bad = 1 - tf.cast(ok, "int64")
        self._skipped_micro_batches.assign_add(bad)
        if self.nonfinite == "skip_window":
            self._window_bad.assign_add(bad)
        if not mask:
            return grads, ok
        # g, or a broadcast scalar zero for a skipped micro-batch.
        keep = lambda x: tf.where(ok, x, tf.zeros((), x.dtype))
        return [map_values(keep, g) for g in grads], ok

    # -- subclass hooks -------------------------------------------------------

    def _accumulate(self, distribution, grads, variables, weight, start):
        raise NotImplementedError

    def _read_window(self, distribution, variables):
        """Window-level totals read once at the boundary (cross-replica),
        handed to `_window_ok` and `_update`; None by default."""
        return None

    def _update(self, distribution, variables, window):
        raise NotImplementedError

    def _window_ok(self, window):
        """A boolean tensor saying whether the window may be applied, or
        None when it always is."""
        return None

    def load_own_variables(self, store):
        # Keras skips loading, with a mere warning, when the saved optimizer
        # has another number of variables (e.g. a changed `steps`): the run
        # would silently restart its moments and lose the window in progress.
        saved = len(store.keys())
        if saved == len(self.variables):
            super().load_own_variables(store)
        elif not self.built:
            # `load_weights` into a model compiled but not trained yet: the
            # state is restored when the optimizer is built (its first step).
            self._deferred_state = [np.array(store[str(i)]) for i in range(saved)]
        elif saved == getattr(self, "_unbuilt_count", None):
            warnings.warn(
                f"Optimizer '{self.name}' was saved before its first step: no "
                "state to restore, it starts afresh.",
                stacklevel=2,
            )
        else:
            raise self._mismatch(saved)

    def _mismatch(self, saved):
        return ValueError(
            f"Cannot restore optimizer '{self.name}': it has {len(self.variables)} "
            f"variables, the saved state has {saved}. Was it saved with another "
            "`steps` or another optimizer? Rebuild it as saved, or leave the "
            "optimizer's state out (`load_model(..., compile=False)`, "
            "`load_weights(..., skip_mismatch=True)`)."
        )

    def _restore_deferred_state(self):
        """End of `build`: the state `load_own_variables` kept for later."""
        state = getattr(self, "_deferred_state", None)
        if state is None:
            return
        self._deferred_state = None
        if len(state) == self._unbuilt_count:
            return  # saved before its first step: nothing to restore
        if len(state) != len(self.variables):
            # Too late to raise where `load_weights(skip_mismatch=True)` could
            # catch it: skip loudly, as Keras does (e.g. pretrained layer
            # weights saved with another optimizer).
            warnings.warn(
                f"{self._mismatch(len(state))} Its saved state is skipped: it starts afresh.",
                stacklevel=2,
            )
            return
        with tf.init_scope():  # once, eagerly, also when built while tracing
            for variable, value in zip(self.variables, state):
                variable.assign(value)

    def get_config(self):
        config = super().get_config()
        config.update({"steps": schedules.serialize_steps(self.steps), "nonfinite": self.nonfinite})
        return config
