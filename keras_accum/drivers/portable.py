"""The JAX and PyTorch driver: `keras.ops`, the window's end a mask or a
Python branch.

TensorFlow's driver (`keras_accum.drivers.tensorflow`) enters cross-replica
context and decides the window's end with a `cond`. Here there is one
device's worth of state (JAX's `DataParallel` hands the optimizer the
global gradient) and each optimizer's rule (`_fold`, `_window_ok`,
`_update` of its class) runs as it is written, with the writes of
`keras_accum.kernels`:

* JAX traces the step (`stateless_apply`: a `StatelessScope` around
  `apply`, traced once by `jit`): the window's start and end are boolean
  tensors and every write of the update is `where(keep, new, old)`,
  straight-line code.
* PyTorch runs it eagerly: the flags are Python bools (`kernels.decided`),
  and nothing of a window's end runs inside a window (a Python `if`, as
  Keras's own accumulation does on PyTorch).

`GradientAccumulation`'s update is another optimizer's step, too costly to
compute on every micro-batch and throw away: under JAX it runs in a
`lax.cond` (`ops.cond`) of the values `stateless_apply` returns, as Keras's
`LossScaleOptimizer` does; under PyTorch in an `if` (`GradientAccumulationForm`).

What TensorFlow alone offers (`tf.distribute`, sparse `IndexedSlices`
gradients, XLA's resource kernels, the custom loop) is refused here in one
line naming the backend.
"""

import contextlib
import warnings

import keras
from keras import ops

from keras_accum import _backend, _compat, kernels, nonfinite
from keras_accum.drivers import torch_processes
from keras_accum.kernels import both, decided, flag, masked

__all__ = ["Driver", "GradientAccumulationForm", "InvariantAdamForm", "UpdateAccumulationAdamForm"]


class Driver:
    """The JAX and PyTorch route of `AccumulationOptimizer.apply`."""

    def _drive(self, pairs, overwrite, weight):
        if self._run_rule(pairs, overwrite, weight) is not None:
            raise RuntimeError(
                f"{type(self).__name__} in a traced JAX step must be applied "
                "through `stateless_apply` (what `model.fit` does)."
            )

    def _run_rule(self, pairs, overwrite, weight):
        """One micro-batch through `apply` below; returns what a traced
        window's end leaves to the caller (`GradientAccumulation`'s means
        and keep flag under JAX), else None."""
        grads = [g for g, _ in pairs]
        if self.loss_scale_factor is not None:
            grads = [g / self.loss_scale_factor for g in grads]
        if self._processes() > 1:
            grads = across_processes(self, grads)
        with keras.name_scope(self.name, caller=self):
            return apply(self, grads, [v for _, v in pairs], weight, overwrite)

    def _check_strategy(self):
        return None  # no tf.distribute strategy here

    def _processes(self):
        """PyTorch processes of a `torch.distributed` group (1 without one),
        asked once (`keras_accum.drivers.torch_processes`)."""
        if "_process_count" not in self.__dict__:
            self.__dict__["_process_count"] = torch_processes.count()
        return self.__dict__["_process_count"]

    def _flush_window(self):
        """`flush`: the window's end now, eagerly, as `apply` ends one; then
        the window's sums and bad count cleared."""
        with keras.name_scope(self.name, caller=self):
            end_window(self, _compat.trainable_variables(self), True)
        for variable in [*self._window_state(), self._window.bad]:
            variable.assign(ops.zeros(variable.shape, variable.dtype))

    def _creation_scope(self):
        return contextlib.nullcontext()


class GradientAccumulationForm:
    """`GradientAccumulation`'s inner step: an eager `if` (PyTorch), or the
    `lax.cond` of `stateless_apply` (JAX)."""

    def _step_inner(self, means, variables, keep):
        # `means` may be a function (`PerDeviceGradients`: each device's
        # sums, reduced only where the inner optimizer steps).
        if isinstance(keep, bool) or _backend.is_concrete(keep):
            if bool(keep):  # PyTorch, or JAX run eagerly
                self.inner_optimizer.apply(means() if callable(means) else means, variables)
            return None
        return means, keep  # traced: stepped in `stateless_apply`'s lax.cond

    def stateless_apply(self, optimizer_variables, grads, trainable_variables, weight=None):
        """Keras's stateless step (JAX), with `apply`'s optional `weight`:
        a jitted custom step passes each micro-batch's item or token count
        here (a traced scalar is fine)."""
        if _backend.BACKEND != "jax":
            if weight is not None:
                raise ValueError(
                    "`stateless_apply(weight=...)` is for JAX's jitted steps; under "
                    f"{_backend.BACKEND} pass `apply(grads, variables, weight=n)`. "
                    f"Received: weight={weight!r}"
                )
            return super().stateless_apply(optimizer_variables, grads, trainable_variables)
        return stateless_inner_step(self, optimizer_variables, grads, trainable_variables, weight)


class InvariantAdamForm:
    """`InvariantAdam` here: its rule as written; a warning under a
    `keras.distribution` that splits the batch (`warn_data_parallel`)."""

    def build(self, var_list):
        super().build(var_list)
        if self._device_route is None:  # `PerDeviceGradients`: kappa = steps x devices
            warn_data_parallel(self)


class UpdateAccumulationAdamForm:
    """`UpdateAccumulationAdam` here: its rule as written."""


def apply(optimizer, grads, variables, weight, overwrite):
    """One micro-batch: screen, fold, count, and at a window's end update
    (what the TensorFlow driver's `_merge_apply` does there). Returns what
    `end_window` returns."""
    policy = optimizer._nonfinite_policy
    if policy.raises and _backend.BACKEND == "jax":
        raise ValueError(
            f"{type(optimizer).__name__}: nonfinite='raise' cannot stop a compiled "
            "JAX step; use 'skip_micro_batch', 'skip_window' or None. "
            "Received: nonfinite='raise'"
        )
    grads = [ops.convert_to_tensor(g) for g in grads]
    # PyTorch, an int `steps`: the window's start and end from the count
    # held in Python (`host_micro_step`), no read of the device.
    state = optimizer._window
    step = host_micro_step(optimizer)
    if step is None:
        start, size, end = state.bounds(optimizer.steps)
        if size is not None:  # a schedule's window, fixed where it starts
            state.size.assign(size)
            state.end.assign(end)
        start = decided(start)
    else:
        start = step % optimizer.steps == 0
    ok = True
    if policy.screens and not checks_sums_at_end(optimizer):
        ok = decided(kernels.finite(grads))
        if policy.raises:
            if not bool(ok):  # eager (PyTorch): one line, as `nonfinite.explained` gives
                step = int(ops.convert_to_numpy(state.micro_step)) + 1
                raise nonfinite.NonFiniteGradientError(
                    f"{optimizer.name}: {nonfinite.MESSAGE} at micro-step {step}"
                )
            ok = True
        else:
            count_bad(optimizer, start, ok)
            if ok is not True:  # a skipped micro-batch reaches the rule as zeros
                grads = [masked(ok, g, ops.zeros_like(g)) for g in grads]
    optimizer._fold(grads, variables, weight, start, ok)
    micro_step = ops.convert_to_tensor(state.micro_step) + 1
    state.micro_step.assign(micro_step)
    if step is not None:
        boundary = (step + 1) % optimizer.steps == 0
        optimizer.__dict__["_host_micro_step"] = (
            _compat.write_stamp(state.micro_step.value),
            step + 1,
        )
    elif optimizer.steps == 1:
        boundary = True
    else:
        boundary = decided(optimizer._window_done(micro_step))
    for grad, variable in overwrite:  # float8 scales: the last gradient
        variable.assign(masked(boundary, ops.cast(grad, variable.dtype), variable))
    return end_window(optimizer, variables, boundary)


def across_processes(optimizer, grads):
    """A micro-batch's gradients under several PyTorch processes, as the
    rule takes them (`optimizer._across_processes`): "sums" each process's
    own (its window sums are all-reduced at the window's end), "parts" its
    share g_r / processes (a micro-batch of the window, as a replica's),
    "gradients" their mean over the processes (every micro-batch)."""
    kind = optimizer._across_processes
    if kind is None:
        raise ValueError(
            f"{type(optimizer).__name__} does not say how it runs under several "
            "torch.distributed processes (`_across_processes`). Received: "
            f"world_size={optimizer._processes()}"
        )
    if kind == "gradients":
        return torch_processes.mean_of([ops.convert_to_tensor(g) for g in grads])
    if kind == "parts":
        return [g / optimizer._processes() for g in grads]
    return grads


def host_micro_step(optimizer):
    """`micro_step` as a Python int where PyTorch runs the step eagerly
    with an int `steps` (else None): held in Python since this driver last
    wrote it, read from the device (a sync) only when something else wrote
    it since (a load, a restore, `assign`); None inside a `StatelessScope`
    or while `torch.compile` traces (the count would be symbolic there)."""
    if not kernels.EAGER or not isinstance(optimizer.steps, int):
        return None
    if _compat.in_stateless_scope() or kernels.compiling():
        return None
    value = optimizer._window.micro_step.value
    held = optimizer.__dict__.get("_host_micro_step")
    if held is not None and _compat.unwritten_since(held[0], value):
        return held[1]
    return int(value)


def checks_sums_at_end(optimizer):
    """True when "skip_window" lets a NaN into the rule's window sums and
    checks them once, at the window's end (eagerly, where the window's end
    runs only at the end; traced, every micro-batch is screened, which fuses
    into the fold)."""
    return (
        kernels.EAGER
        and optimizer._nonfinite_policy.drops_windows
        and optimizer._checks_window_sums
    )


def count_bad(optimizer, start, ok):
    """A skipped micro-batch counted (`ok` False; under "skip_window" only
    where the rule's sums would show it), and in the window's `window_bad`;
    eagerly (Python bools) nothing is written for a good micro-batch inside
    a window."""
    policy = optimizer._nonfinite_policy
    skips = policy.skips and not (policy.drops_windows and optimizer._checks_window_sums)
    state = optimizer._window
    if isinstance(ok, bool) and isinstance(start, bool):
        if not ok and skips:
            state.skipped_micro_batches.assign(state.skipped_micro_batches + 1)
        if start or not ok:
            before = 0 if start else ops.convert_to_tensor(state.bad)
            state.bad.assign(before + (0 if ok else 1))
        return
    bad = 1 - flag(ok, _backend.INT)
    if skips:
        state.skipped_micro_batches.assign(state.skipped_micro_batches + bad)
    window_bad = masked(start, ops.zeros((), _backend.INT), state.bad)
    state.bad.assign(window_bad + bad)


def end_window(optimizer, variables, boundary):
    """The window's update where `boundary` holds and the window may be
    applied; the drop counted where it may not. Returns what the rule's
    `_update` returns where the inner optimizer steps (`_steps_inner`),
    else None."""
    if boundary is False:
        return None  # eager, inside a window: nothing of the window's end runs
    processes = optimizer._processes()
    if processes > 1 and optimizer._across_processes != "gradients":
        # PyTorch processes: the window's one all-reduce, before its checks
        # (every process then applies, or drops, the same window).
        torch_processes.sum_in_place(optimizer._process_sums() + [optimizer._window.bad])
    if checks_sums_at_end(optimizer):  # eager: a NaN of the window is in its sums
        window_ok = decided(
            kernels.finite([ops.convert_to_tensor(s) for s in optimizer._window_sums()])
        )
    else:
        window_ok = decided(optimizer._window_ok(boundary))
    keep = both(boundary, window_ok)
    if window_ok is not True:
        dropped = both(boundary, window_ok is False or ops.logical_not(window_ok))
        if dropped is not False:
            counter = optimizer._window.skipped_updates
            counter.assign(counter + flag(dropped, _backend.INT))
        if dropped is True:  # eager: no NaN left in the sums (if any entered)
            for total in optimizer._window_sums():
                total.assign(ops.zeros_like(total))
    if keep is False:
        return None
    result = optimizer._update(variables, keep)
    if processes > 1 and optimizer._across_processes == "parts":
        # Each process keeps total / processes: their sum is the moment.
        for part in optimizer._process_sums():
            part.assign(ops.convert_to_tensor(part) / processes)
    if optimizer._steps_inner:
        return result  # the inner optimizer counts, averages and constrains
    if optimizer.use_ema:  # kappa counts each device's micro-batch (`PerDeviceGradients`)
        route = getattr(optimizer, "_device_route", None)
        kernels.update_ema(optimizer, keep, processes if route is None else route.devices)
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(masked(keep, variable.constraint(variable), variable))
    counter = _compat.update_counter(optimizer)
    counter.assign(counter + flag(keep, counter.dtype))


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
    with keras.StatelessScope(state_mapping=mapping) as scope:
        # (means, keep) from `GradientAccumulationForm._step_inner`: returned,
        # not parked on the instance.
        pending = optimizer._run_rule(*optimizer._checked_pairs(grads, None, weight))
    if pending is not None:
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

    def step():  # the reduction of per-device sums, if any, in this branch
        window_means = means() if callable(means) else means
        return inner.stateless_apply(inner_values, window_means, trainable_variables)

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
    devices = _data_parallel_devices()
    if devices > 1:
        warnings.warn(
            f"{type(optimizer).__name__} under keras.distribution on {devices} devices: "
            "each step's gradient arrives averaged over them, so kappa = steps (one "
            "micro-batch per step), not steps x devices as under tf.distribute. A model "
            "with the mixin keras_accum.PerDeviceGradients counts steps x devices.",
            stacklevel=4,
        )
