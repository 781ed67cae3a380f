"""Batch-size invariant Adam (Wang & Aitchison 2024, arXiv:2402.18824)."""

import operator
from typing import Any

import keras
from keras import ops, saving

from keras_accum import (
    _backend,
    _compat,
    _replicas,
    drivers,
    equations,
    kernels,
    scaling,
    schedules,
)
from keras_accum.adam_family import AdamFamily


@saving.register_keras_serializable(package="keras_accum")
class InvariantAdam(drivers.InvariantAdamForm, AdamFamily):
    r"""Adam whose second moment averages *squared* micro-batch gradients.

    Batch-size invariant Adam (Wang & Aitchison 2024, arXiv:2402.18824).
    With kappa micro-batches per update (kappa = steps x replicas in sync)
    and micro-batch mean gradients g_j, update k does:

    .. math::

        m &= \beta_1 m + (1 - \beta_1) \frac{1}{\kappa} \sum_j g_j \\
        v &= \beta_2 v + (1 - \beta_2) \frac{1}{\kappa} \sum_j g_j^2 \\
        \alpha_k &= \mathrm{lr} \, \sqrt{1 - \beta_2^k} / (1 - \beta_1^k) \\
        \theta &= \theta - \alpha_k \, m / (\sqrt{v} + \epsilon)

    :math:`E[\overline{g^2}] = |G|^2 + \sigma^2` does not depend on kappa, so
    with `learning_rate` and `1 - beta_i` scaled linearly with kappa
    (`scaling_rule="invariant"`) neither does the curve against examples seen,
    at small learning rates. Each replica's (or `PerDeviceGradients` device's)
    gradient is a micro-batch; under JAX `DataParallel` without that mixin,
    Keras's `train_step` all-reduces the gradients first: kappa = steps.

    Warning: epsilon is outside the square root, as in `keras.optimizers.Adam`
    (`steps=1` on one replica is Keras's Adam, bit for bit, for dense
    gradients); the authors' code uses `sqrt(v + eps)`. See docs/ALGORITHMS.md
    and docs/guides/adam.md (a `steps` schedule, sparse gradients, clipping).

    Args:
        learning_rate: float, schedule (sees the update count, or with a
            `scaling_rule` the micro-batches consumed) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-batches per update on each replica: an integer >= 1 or
            a schedule (`keras_accum.PiecewiseSteps`, `AdaptiveSteps`).
        scaling_rule: None (hyperparameters used as given, whatever kappa),
            "invariant", "power" or "fixed_beta_1", applied per window.
        nonfinite: `"skip_micro_batch"` (a zero gradient), `"raise"` or None.
        weight_decay: optional decoupled weight decay, once per update.
        state_dtype: the moments' dtype for a bfloat16 or float16 variable:
            "float32" (default) or None (the variable's own, as Keras's Adam).
        flush_last_window: refused: a partial window cannot be applied.
        name: optimizer name.
    """

    _per_device_sums = True  # may keep each device's parts of m, v (`PerDeviceGradients`)
    _across_processes = "parts"  # each process's gradient a micro-batch of the window
    _refuses_flush = (
        "InvariantAdam folds each micro-batch into its moments with its window's "
        "size, so a partial window cannot be applied as a window of its own; end "
        "training on a window's boundary."
    )

    def __init__(
        self,
        *args: Any,
        name: str = "invariant_adam",
        scaling_rule: str | None = None,
        **kwargs: Any,
    ):
        if kwargs.get("nonfinite") == "skip_window":  # the user's value, named
            raise ValueError(
                "InvariantAdam folds each micro-batch into its moments and "
                "cannot drop a window afterwards; use 'skip_micro_batch' or "
                "'raise'. Received: nonfinite='skip_window'"
            )
        super().__init__(*args, name=name, **kwargs)
        # Set by a `PerDeviceGradients` compile (JAX): m, v hold one part per device.
        self._device_route = None
        # One replica until `build` knows the strategy's replica count.
        self.scaling_rule = scaling.check_scaling_rule(
            scaling_rule, self.beta_1, self.beta_2, schedules.steps_range(self.steps)[1]
        )

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = [], []
        route = self._device_route
        for var in var_list:
            dtype = self._slot_dtype(var.dtype)  # float32 for a bfloat16 variable
            for slots, name in ((self._momentums, "momentum"), (self._velocities, "velocity")):
                if route is None:
                    slots.append(self.add_local_variable(var.shape, dtype, name, reference=var))
                else:
                    slots.append(route.add_variable(self, var, name, dtype))
        self._build_scaling()
        self._restore_deferred_state()

    def _single_step(self):
        """True for a constant `steps=1` (the fold needs no window-start flag)."""
        steps = self.window_steps
        return isinstance(steps, int) and steps == 1

    # -- hyperparameters that follow the window size (`scaling_rule`) --------

    def _build_scaling(self):
        # Each device's gradient is a micro-batch under `PerDeviceGradients`.
        replicas = _replicas.count_at_build(self) * self._devices()
        max_kappa = schedules.steps_range(self.steps)[1] * replicas
        scaling.check_scaling_rule(self.scaling_rule, self.beta_1, self.beta_2, max_kappa)
        if self.scaling_rule is None:
            return
        # P_i = prod over windows so far of beta_i,k (bias correction).
        self._beta_products = [
            self.add_variable(
                (),
                initializer="ones",
                dtype="float32",
                aggregation="only_first_replica",
                name=f"beta_{i}_product",
            )
            for i in (1, 2)
        ]

    def _window_factors(self, replicas):
        """(steps, 1 - beta_1,k, 1 - beta_2,k) of the current window."""
        steps = self.window_steps
        if not isinstance(steps, int):
            steps = ops.cast(steps, "float32")
        kappa = steps * replicas
        form_1, form_2 = scaling.BETA_FORMS[self.scaling_rule]
        return (
            steps,
            equations.one_minus_beta(self.beta_1, kappa, form_1),
            equations.one_minus_beta(self.beta_2, kappa, form_2),
        )

    def _scaled_rate(self, replicas, keep=True):
        """(lr_k, sqrt(1 - P_2) / (1 - P_1)), folding this window's betas into
        P_1, P_2 where `keep` holds."""
        steps, beta_1_rate, beta_2_rate = self._window_factors(replicas)
        kappa = steps * replicas
        p_1, p_2 = self._beta_products
        # P_i = P_i * beta_i,k
        new_1, new_2 = p_1 * (1 - beta_1_rate), p_2 * (1 - beta_2_rate)
        p_1.assign(kernels.masked(keep, new_1, p_1))
        p_2.assign(kernels.masked(keep, new_2, p_2))
        correction = ops.sqrt(1 - new_2) / (1 - new_1)
        schedule = _compat.learning_rate_schedule(self)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            # A schedule for kappa = 1 sees the micro-batches consumed before this window.
            window = ops.cast(self.window_steps, _backend.INT)
            before = (ops.convert_to_tensor(self._window.micro_step) - window) * replicas
            learning_rate = schedule(before)
        else:
            learning_rate = self.learning_rate
        # lr_k = kappa_k * lr
        return ops.cast(learning_rate, "float32") * kappa, correction

    def _ema_momentum_of_window(self, replicas=1):
        """rho_k = ema_momentum ** kappa_k with a `scaling_rule`, else None."""
        if self.scaling_rule is None:
            return None
        steps = self.window_steps  # kappa_k = steps x replicas
        if isinstance(steps, int):
            return self.ema_momentum ** (steps * replicas)  # a Python float, as Keras's
        kappa = ops.cast(steps, "float32") * replicas
        return ops.power(ops.convert_to_tensor(self.ema_momentum, "float32"), kappa)

    # -- the rule: pure functions of values, which every driver runs ----------

    @staticmethod
    def fold_factors(first, steps, square_factor, rate_1, rate_2):
        """((keep_1, keep_2), (take_1, take_2)) of one micro-batch:
        keep_i = 1 - first (1 - beta_i,k) (`first` is 1 at a window's start),
        take_1 = (1 - beta_1,k) / steps, take_2 = (1 - beta_2,k) square_factor
        (replicas / steps: g = g_r / replicas is undone before squaring)."""
        keep = (1.0 - first * rate_1, 1.0 - first * rate_2)
        return keep, (rate_1 / steps, rate_2 * square_factor)

    @staticmethod
    def increments(g, take, times=operator.mul):
        """(g take_1, g**2 take_2): what one micro-batch adds to m and v (also
        row by row, for a sparse gradient). `times` may be `multiply_no_nan`."""
        take_1, take_2 = take
        return times(g, take_1), times(ops.square(g), take_2)

    @staticmethod
    def fold(m, v, g, keep, take, times=operator.mul):
        """(m keep_1 + g take_1, v keep_2 + g**2 take_2)."""
        keep_1, keep_2 = keep
        change_m, change_v = InvariantAdam.increments(g, take, times)
        return m * keep_1 + change_m, v * keep_2 + change_v

    @staticmethod
    def step(m, v, alpha, epsilon):
        """alpha m / (sqrt(v) + epsilon), subtracted at the window's end."""
        return equations.adam_step(m, v, alpha, epsilon)

    def alpha(self, learning_rate, correction, dtype):
        """The window's alpha in `dtype`: Keras Adam's at count `correction`,
        or with a `scaling_rule` lr_k sqrt(1 - P_2) / (1 - P_1)."""
        if self.scaling_rule is None:
            return self._adam_alpha(learning_rate, correction, dtype)
        return ops.cast(learning_rate * correction, dtype)

    def rate_and_correction(self, replicas=1, keep=True):
        """(learning rate, correction) of `alpha` for the window ending now."""
        if self.scaling_rule is None:
            return self.learning_rate, _compat.update_counter(self) + 1
        return self._scaled_rate(replicas, keep)

    # -- how JAX and PyTorch write it (`keras_accum.drivers.portable`) ---------

    def _devices(self):
        """Devices (`PerDeviceGradients`) or processes each folded as a micro-batch."""
        if self._device_route is not None:
            return self._device_route.devices
        return self._processes()

    def _process_sums(self):
        return self._momentums + self._velocities

    def _fold(self, grads, variables, weight, start, ok):
        indices = [_compat.variable_index(self, v) for v in variables]
        momentums = [self._momentums[i] for i in indices]
        velocities = [self._velocities[i] for i in indices]
        # (A skipped micro-batch comes as zeros: a zero gradient in the window.)
        grads = [ops.cast(g, m.dtype) for g, m in zip(grads, momentums)]
        # Per device: each row of `grads` is g_d / devices, folded into its part.
        devices = self._devices()
        route = self._device_route
        if route is not None and self._clips():  # each device's micro-batch clipped
            grads = route.each_row(lambda row: self._clip_micro_batch(row, devices), grads)
        else:
            grads = self._clip_micro_batch(grads, 1)
        steps, rate_1, rate_2 = self._window_factors(devices)
        if self._single_step() and devices == 1:  # Keras Adam's form and rounding
            kernels.adam_moments(momentums, velocities, grads, rate_1, rate_2)
            return
        first = kernels.flag(start, "float32")
        keep, take = self.fold_factors(first, steps, devices / steps, rate_1, rate_2)
        kernels.decayed_moments(momentums, velocities, grads, keep, take, self.fold)

    def _update(self, variables, keep):
        learning_rate, correction = self.rate_and_correction(self._devices(), keep)
        indices = [_compat.variable_index(self, var) for var in variables]
        momentums = [self._momentums[i] for i in indices]
        alphas = {}  # alpha_t, once per dtype of the moments
        for m in momentums:
            if m.dtype not in alphas:
                alphas[m.dtype] = self.alpha(learning_rate, correction, m.dtype)
        # theta = decayed(theta) - alpha m / (sqrt(v) + epsilon), in theta's dtype
        moments = (
            momentums,
            [self._velocities[i] for i in indices],
            [alphas[m.dtype] for m in momentums],
            self.epsilon,
        )
        if self._device_route is None:
            steps = kernels.adam_steps(*moments)
        else:  # the devices' parts summed where the window ends, only there
            steps = self._device_route.window_steps(keep, *moments)
        decays = [self._decay_of(var, learning_rate) for var in variables]
        kernels.subtract(variables, steps, keep, decays)

    def get_config(self):
        config = super().get_config()
        config["scaling_rule"] = self.scaling_rule
        return config
