"""The JAX and PyTorch driver: each rule as written with `kernels`' writes;
the window's end a `where` mask (JAX, traced) or a Python `if` (PyTorch).
`GradientAccumulation`'s inner step runs in a `lax.cond` (JAX) or an `if`.
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
        """One micro-batch; returns GA's pending (means, keep) under JAX."""
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
        """PyTorch processes of the `torch.distributed` group, asked once."""
        if "_process_count" not in self.__dict__:
            self.__dict__["_process_count"] = torch_processes.count()
        return self.__dict__["_process_count"]

    def _flush_window(self):
        """`flush`: the window's end now, then its sums and bad count cleared."""
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
        # `means` may be a function (`PerDeviceGradients`: reduced only here).
        if isinstance(keep, bool) or _backend.is_concrete(keep):
            if bool(keep):  # PyTorch, or JAX run eagerly
                self.inner_optimizer.apply(means() if callable(means) else means, variables)
            return None
        return means, keep  # traced: stepped in `stateless_apply`'s lax.cond

    def stateless_apply(self, optimizer_variables, grads, trainable_variables, weight=None):
        """Keras's stateless step (JAX), with `apply`'s optional `weight`
        (a traced scalar is fine)."""
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
    """`InvariantAdam`: its rule; warns when `keras.distribution` splits
    the batch."""

    def build(self, var_list):
        super().build(var_list)
        if self._device_route is None:  # `PerDeviceGradients`: kappa = steps x devices
            warn_data_parallel(self)


class UpdateAccumulationAdamForm:
    """`UpdateAccumulationAdam` here: its rule as written."""


def apply(optimizer, grads, variables, weight, overwrite):
    """One micro-batch: screen, fold, count, and at a window's end update.
    Returns what `end_window` returns."""
    policy = optimizer._nonfinite_policy
    if policy.raises and _backend.BACKEND == "jax":
        raise ValueError(
            f"{type(optimizer).__name__}: nonfinite='raise' cannot stop a compiled "
            "JAX step; use 'skip_micro_batch', 'skip_window' or None. "
            "Received: nonfinite='raise'"
        )
    grads = [ops.convert_to_tensor(g) for g in grads]
    # PyTorch, an int `steps`: the count held in Python, no device sync.
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
            if not bool(ok):  # eager (PyTorch)
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
    """Gradients under several PyTorch processes, by `_across_processes`:
    "sums": as they are (window sums all-reduced at its end); "parts":
    g_r / processes (each a micro-batch); "gradients": mean over processes."""
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
    """`micro_step` as an int on eager PyTorch with an int `steps`, else
    None; read from the device only after a write from elsewhere."""
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
    """True when "skip_window" checks the window sums once at its end
    (eager only; traced, the screen fuses into the fold)."""
    return (
        kernels.EAGER
        and optimizer._nonfinite_policy.drops_windows
        and optimizer._checks_window_sums
    )


def count_bad(optimizer, start, ok):
    """Counts a skipped micro-batch (`ok` False) and the window's bad ones;
    eagerly, a good one inside a window writes nothing."""
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
    """The window's update where `boundary` and `_window_ok` hold, else the
    drop counted. Returns `_update`'s result under `_steps_inner`."""
    if boundary is False:
        return None  # eager, inside a window: nothing of the window's end runs
    processes = optimizer._processes()
    if processes > 1 and optimizer._across_processes != "gradients":
        # The window's one all-reduce, before the checks: all agree.
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
    """GA's `stateless_apply` on JAX: the fold in a `StatelessScope`, the
    inner stateless step in a `lax.cond`."""
    own = _compat.own_variables(optimizer)
    inner = optimizer.inner_optimizer
    # Values: a `LossScaleOptimizer` hands in variables; `cond` needs arrays.
    optimizer_variables = [ops.convert_to_tensor(v) for v in optimizer_variables]
    trainable_variables = [ops.convert_to_tensor(v) for v in trainable_variables]
    mapping = list(zip(_compat.trainable_variables(optimizer), trainable_variables))
    mapping += list(zip(optimizer.variables, optimizer_variables))
    with keras.StatelessScope(state_mapping=mapping) as scope:
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
    """Devices on the batch axis of the `keras.distribution` (1 without)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    batch_axis = getattr(distribution, "batch_dim_name", None)
    if batch_axis in mesh.axis_names:
        return int(mesh.shape[list(mesh.axis_names).index(batch_axis)])
    return int(mesh.devices.size)


def warn_data_parallel(optimizer):
    """Warns that kappa = steps (not steps x devices) when a
    `keras.distribution` averages the gradient over devices."""
    devices = _data_parallel_devices()
    if devices > 1:
        warnings.warn(
            f"{type(optimizer).__name__} under keras.distribution on {devices} devices: "
            "each step's gradient arrives averaged over them, so kappa = steps (one "
            "micro-batch per step), not steps x devices as under tf.distribute. A model "
            "with the mixin keras_accum.PerDeviceGradients counts steps x devices.",
            stacklevel=4,
        )
