"""The route of one `apply` under JAX and PyTorch: `keras.ops`, no branch.

TensorFlow's route (`keras_accum.base`) enters cross-replica context and
decides the window's end with a `cond`. Here there is one device's worth
of state (JAX's `DataParallel` hands the optimizer the global gradient) and
the window's end is a 0/1 mask: every write of the update is
`where(keep, new, old)`, so that JAX's `stateless_apply` (a
`StatelessScope` around `apply`, traced once by `jit`) sees straight-line
code. Under PyTorch the same code runs eagerly.

`GradientAccumulation` is the exception: its update is another optimizer's
step, too costly to compute on every micro-batch and throw away. Under
JAX it runs in a `lax.cond` (`ops.cond`) of the values `stateless_apply`
returns, as Keras's `LossScaleOptimizer` does; under PyTorch in an eager
`if`.

What TensorFlow alone offers (`tf.distribute`, sparse `IndexedSlices`
gradients, XLA's resource kernels, the custom loop) is refused here in one
line naming the backend. `AdaptiveSteps` is `keras.ops` and runs here.
"""

import warnings

import keras
from keras import ops

from keras_accum import _backend, _compat, nonfinite

# PyTorch runs each call eagerly: there a window's start, its end and a
# micro-batch's screen are read as Python bools, and what a window's end
# computes runs only at the end (a Python `if`, as Keras's own accumulation
# does on PyTorch). JAX traces the step: there they stay boolean tensors and
# every write is `where(keep, new, old)`.
EAGER = _backend.BACKEND == "torch"


def decided(condition):
    """`condition` as a Python bool where the step runs eagerly (PyTorch);
    unchanged (a boolean tensor, or already a bool) under JAX."""
    if EAGER and not isinstance(condition, bool):
        return bool(condition)
    return condition


def masked(keep, new, old):
    """`new` where `keep` holds, else `old`; `new` (`old`) when `keep` is
    True (False)."""
    if keep is True:
        return new
    if keep is False:
        return old
    return ops.where(keep, ops.convert_to_tensor(new), ops.convert_to_tensor(old))


def both(a, b):
    """Logical and of two flags (Python bools or boolean tensors)."""
    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    if a is True or b is True:
        return b if a is True else a
    if a is False or b is False:
        return False
    return ops.logical_and(a, b)


def flag(condition, dtype):
    """A boolean scalar (or Python bool) as 0/1 of `dtype`."""
    if isinstance(condition, bool):
        return int(condition)
    return ops.cast(condition, dtype)


def all_finite(grads):
    """True when no gradient holds a NaN or an Inf (exact).

    Eagerly (PyTorch) a NaN or an Inf propagates into a sum: one reduction
    per gradient, no boolean tensor; the elementwise test runs only if a
    float32 sum overflowed (as `nonfinite.all_finite` on TensorFlow)."""
    if EAGER:
        sums = ops.stack([ops.sum(ops.cast(g, "float32")) for g in grads])
        if bool(ops.all(ops.isfinite(sums))):
            return True
    checks = [ops.all(ops.isfinite(g)) for g in grads]
    result = checks[0]
    for check in checks[1:]:
        result = ops.logical_and(result, check)
    return result


def apply(optimizer, grads, variables, weight, overwrite):
    """One micro-batch: screen, fold, count, and at a window's end update
    (the portable form of `AccumulationOptimizer._merge_apply`)."""
    if optimizer.nonfinite == "raise" and _backend.BACKEND == "jax":
        raise ValueError(
            f"{type(optimizer).__name__}: nonfinite='raise' cannot stop a compiled "
            "JAX step; use 'skip_micro_batch', 'skip_window' or None. "
            "Received: nonfinite='raise'"
        )
    grads = [ops.convert_to_tensor(g) for g in grads]
    start = decided(optimizer._start_window())
    ok = True
    screens = optimizer.nonfinite in ("skip_micro_batch", "raise") or (
        optimizer.nonfinite == "skip_window" and not optimizer._checks_window_sums
    )
    if screens:
        ok = decided(all_finite(grads))
        if optimizer.nonfinite == "raise":
            if not bool(ok):  # eager (PyTorch): one line, as `nonfinite.explained` gives
                step = int(ops.convert_to_numpy(optimizer._micro_step)) + 1
                raise nonfinite.NonFiniteGradientError(
                    f"{optimizer.name}: {nonfinite.MESSAGE} at micro-step {step}"
                )
            ok = True
        else:
            bad = 1 - flag(ok, _backend.INT)
            optimizer._skipped_micro_batches.assign(optimizer._skipped_micro_batches + bad)
            window_bad = masked(start, ops.zeros((), _backend.INT), optimizer._window_bad)
            optimizer._window_bad.assign(window_bad + bad)
    optimizer._portable_fold(grads, variables, weight, start, ok)
    micro_step = ops.convert_to_tensor(optimizer._micro_step) + 1
    optimizer._micro_step.assign(micro_step)
    boundary = True if optimizer.steps == 1 else decided(optimizer._window_done(micro_step))
    for grad, variable in overwrite:  # float8 scales: the last gradient
        variable.assign(masked(boundary, ops.cast(grad, variable.dtype), variable))
    end_window(optimizer, variables, boundary)


def end_window(optimizer, variables, boundary):
    """The window's update where `boundary` holds and the window may be
    applied; the drop counted where it may not."""
    if boundary is False:
        return  # eager, inside a window: nothing of the window's end runs
    window_ok = decided(optimizer._portable_window_ok(boundary))
    keep = both(boundary, window_ok)
    if window_ok is not True:
        dropped = both(boundary, window_ok is False or ops.logical_not(window_ok))
        if dropped is not False:
            counter = optimizer._skipped_updates
            counter.assign(counter + flag(dropped, _backend.INT))
            optimizer._portable_drop(dropped)
    if keep is False:
        return
    optimizer._portable_update(variables, keep)
    if optimizer._portable_steps_inner:
        return  # the inner optimizer counted, averaged and constrained
    if optimizer.use_ema:
        update_ema(optimizer, keep)
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(masked(keep, variable.constraint(variable), variable))
    counter = _compat.update_counter(optimizer)
    counter.assign(counter + flag(keep, counter.dtype))


def update_ema(optimizer, keep):
    """Keras's EMA step of the weights after an update (momentum
    `optimizer._ema_momentum_of_window()`), and its periodic overwrite."""
    trained = _compat.trainable_variables(optimizer)
    momentum_of_window = optimizer._ema_momentum_of_window()
    first = ops.equal(ops.convert_to_tensor(optimizer.iterations), 0)
    for var, average in zip(trained, _compat.ema_averages(optimizer)):
        if average is None:
            continue
        # The first update copies the weights (momentum 0), as in Keras.
        momentum = ops.cast(ops.logical_not(first), var.dtype) * ops.cast(
            momentum_of_window, var.dtype
        )
        new = momentum * average + (1 - momentum) * var
        average.assign(masked(keep, new, average))
    frequency = optimizer.ema_overwrite_frequency
    if frequency:
        due = ops.equal((optimizer.iterations + 1) % frequency, 0)
        due = due if keep is True else ops.logical_and(keep, due)
        for var, average in zip(trained, _compat.ema_averages(optimizer)):
            if average is not None:
                var.assign(masked(due, average, var))


def stateless_inner_step(optimizer, optimizer_variables, grads, trainable_variables, weight=None):
    """`GradientAccumulation.stateless_apply` under JAX: the fold in a
    `StatelessScope`, then the inner optimizer's stateless step in a
    `lax.cond` whose other branch hands the values back unchanged."""
    own = _compat.own_variables(optimizer)
    inner = optimizer.inner_optimizer
    # Values, not variables: a `LossScaleOptimizer` hands in the variables
    # themselves (read through its own scope), and a `lax.cond` branch
    # must return arrays.
    optimizer_variables = [ops.convert_to_tensor(v) for v in optimizer_variables]
    trainable_variables = [ops.convert_to_tensor(v) for v in trainable_variables]
    mapping = list(zip(_compat.trainable_variables(optimizer), trainable_variables))
    mapping += list(zip(optimizer.variables, optimizer_variables))
    pending = []  # (means, keep), from `_portable_update`
    optimizer.__dict__["_pending_inner"] = pending  # not a tracked attribute
    try:
        with keras.StatelessScope(state_mapping=mapping) as scope:
            optimizer.apply(grads, weight=weight)
    finally:
        del optimizer.__dict__["_pending_inner"]
    if pending:
        means, keep = pending
    else:  # the window's end was decided in Python (a concrete value)
        trained = _compat.trainable_variables(optimizer)
        return (
            [scope.get_current_value(v) for v in trained],
            [scope.get_current_value(v) for v in optimizer.variables],
        )
    own_values = [scope.get_current_value(v) for v in own]
    inner_values = list(optimizer_variables[len(own) :])
    trainable_variables = list(trainable_variables)

    def step():
        return inner.stateless_apply(inner_values, means, trainable_variables)

    def hold():
        return trainable_variables, inner_values

    new_trainable, new_inner = ops.cond(keep, step, hold)
    return list(new_trainable), own_values + list(new_inner)


def _data_parallel_devices():
    """Devices along the batch axis of the `keras.distribution` in scope
    (1 without one): those a step's gradient is averaged over before the
    optimizer sees it. A `ModelParallel` whose batch axis has one device
    splits no batch."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    batch_axis = getattr(distribution, "batch_dim_name", None)
    if batch_axis in mesh.axis_names:
        return int(mesh.shape[list(mesh.axis_names).index(batch_axis)])
    return int(mesh.devices.size)


def warn_data_parallel(optimizer):
    """Under `keras.distribution` with a batch split over several devices
    the optimizer sees the gradient averaged over them: `InvariantAdam`
    then squares one gradient per step, so kappa = steps, not steps x
    devices as under `tf.distribute` (where each replica's gradient is a
    micro-batch)."""
    if _backend.IS_TENSORFLOW:
        return
    devices = _data_parallel_devices()
    if devices > 1:
        warnings.warn(
            f"{type(optimizer).__name__} under keras.distribution on {devices} devices: "
            "each step's gradient arrives averaged over them, so kappa = steps (one "
            "micro-batch per step), not steps x devices as under tf.distribute.",
            stacklevel=3,
        )
