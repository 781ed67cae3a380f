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

    With kappa micro-batches per update (kappa = steps x replicas in sync)
    and micro-batch mean gradients g_j, update k does:

    .. math::

        m &= \beta_1 m + (1 - \beta_1) \frac{1}{\kappa} \sum_j g_j \\
        v &= \beta_2 v + (1 - \beta_2) \frac{1}{\kappa} \sum_j g_j^2 \\
        \alpha_k &= \mathrm{lr} \, \sqrt{1 - \beta_2^k} / (1 - \beta_1^k) \\
        \theta &= \theta - \alpha_k \, m / (\sqrt{v} + \epsilon)

    Standard accumulation squares the averaged gradient, and
    :math:`E[(\bar g)^2] = |G|^2 + \sigma^2 / \kappa` depends on kappa; here
    :math:`E[\overline{g^2}] = |G|^2 + \sigma^2` does not. Holding the micro-batch size
    fixed and scaling `learning_rate` and `1 - beta_i` linearly with kappa
    (`keras_accum.scale_hyperparameters(rule="invariant")`), training curves
    versus examples seen stay the same when kappa changes (for small enough
    learning rates).

    No buffer beyond Adam's two moments: each micro-batch is folded into m
    and v as it arrives (the first of a window also applies the decay), and
    only the last one moves theta. Under `tf.distribute`, every replica's
    gradient is a micro-batch and is squared before the cross-replica mean;
    m and v are replica-local sums, all reduced in one batched all-reduce
    per window.

    **JAX's `keras.distribution` (`DataParallel`, or a `ModelParallel`
    with a batch axis of several devices).** Keras's JAX `train_step`
    differentiates the loss of the whole sharded batch inside one
    `jax.jit` (keras/src/backend/jax/trainer.py, Keras 3.15.1: line 131,
    `jax.value_and_grad`; line 275, `jit`), so XLA all-reduces the
    devices' gradients before `stateless_apply` (line 151) receives them:
    with Keras's `train_step` each step's gradient is one micro-batch of
    the global batch, kappa = steps, and the optimizer warns once. With
    the model mixin `keras_accum.PerDeviceGradients` (one line, see
    `keras_accum.per_device`) each device's gradient is a micro-batch, as
    under `tf.distribute`: kappa = steps x devices, m and v are kept as
    one part per device (their sum is the moment) and summed over the
    devices once per window, inside the window's end (a `cond`); nothing
    parameter-sized is communicated on the other micro-batches. There
    Keras's clipping arguments clip each device's micro-batch, and the
    state saved has one row per device.

    Conventions:

    * epsilon sits outside the square root as in `keras.optimizers.Adam`, so
      that `steps=1` on one replica is Keras Adam, bit for bit, for
      float32, float16 and bfloat16 variables and under mixed_float16,
      except for an `Embedding` whose rows repeat within a batch: Keras's
      Adam squares each row of the `tf.IndexedSlices` before the rows of a
      token are summed, this optimizer sums them first (the exact batch
      gradient) and equals Keras's Adam given the dense gradient. The authors' code
      (github.com/xidulu/batch_size_invariant_adamW) puts it inside
      (`sqrt(v + eps)`, eps=1e-16).
    * Gradients arrive in the Keras convention (each replica's share of the
      global mean, i.e. g_r / replicas); the factor is undone before
      squaring, which assumes equal micro-batches on all replicas.
    * `nonfinite="skip_micro_batch"` counts a non-finite micro-batch as a
      zero gradient in its window's averages (the fold cannot renormalise
      without extra buffers); `"skip_window"` is therefore not offered.
    * `weight_decay` is decoupled (AdamW style), applied once per update.
    * A sparse gradient (`tf.IndexedSlices`, from an `Embedding` of 65,536
      elements or more) is folded in row by row: the window's decay, then
      its rows into m and v (repeated rows summed before squaring, as in
      the dense gradient); unless micro-batches are clipped or `steps=1`.
    * Keras's `clipnorm`, `clipvalue` and `global_clipnorm` clip each
      micro-batch's gradient before it enters m and v (the global norm is
      over that micro-batch's gradients on its replica); `use_ema` and
      variable constraints act once per update; `loss_scale_factor`
      unscales every micro-batch; `overwrite_with_gradient` variables take
      the last micro-batch's gradient at the window's end. With `steps=1` on
      one replica all of these equal `keras.optimizers.Adam`.

    **Changing kappa during a run.** `steps` may be a schedule
    (`keras_accum.PiecewiseSteps`, `keras_accum.AdaptiveSteps`); each window
    k then has its own kappa_k, fixed when it starts. With a `scaling_rule`,
    `learning_rate`, `beta_1`, `beta_2` and `epsilon` are the values tuned
    for ONE micro-batch per update and window k uses::

        lr_k = kappa_k * lr
        1 - beta_i,k = kappa_k * (1 - beta_i)   ("invariant")
        beta_i,k = beta_i ** kappa_k            ("power")
        beta_1,k = beta_1, beta_2,k = beta_2 ** kappa_k   ("fixed_beta_1")
        P_i = prod over windows so far of beta_i,k   (state, checkpointed)
        alpha_k = lr_k * sqrt(1 - P_2) / (1 - P_1)
        rho_k = ema_momentum ** kappa_k         (with `use_ema=True`)
        theta = theta * (1 - lr_k * weight_decay)   (decoupled decay)

    (epsilon unchanged). The weight decay per window is kappa_k times that
    of one micro-batch (to first order in lr * weight_decay), the same per
    example, under every rule. With a constant kappa P_i = beta_i,k ** k,
    i.e. `InvariantAdam(**scale_hyperparameters(kappa, rule, ...))` with
    `ema_momentum=ema_momentum ** kappa`; after a
    switch, P keeps the betas the earlier windows really used. A
    learning-rate schedule is then evaluated at the number of micro-batches
    consumed over all replicas before the window, so one written for
    kappa = 1 keeps its meaning. "invariant" is refused (naming the beta)
    when a window of the schedule would make a beta <= 0; "power" never is.

    Args:
        learning_rate: float, schedule (sees the update count, or with a
            `scaling_rule` the micro-batches consumed) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-batches per update on each replica: an integer >= 1 or
            a schedule (`keras_accum.PiecewiseSteps`, `AdaptiveSteps`).
        scaling_rule: None (the hyperparameters are used as given, whatever
            kappa), "invariant", "power" or "fixed_beta_1" (see above).
        nonfinite: `"skip_micro_batch"`, `"raise"` or None.
        weight_decay: optional decoupled weight decay.
        state_dtype: the moments' dtype for a bfloat16 or float16 variable:
            "float32" (default) or None (the variable's own, as Keras's Adam).
        flush_last_window: refused (see `_refuses_flush`).
        name: optimizer name.
    """

    _per_device_sums = True  # may keep each device's parts of m, v (`PerDeviceGradients`)
    _across_processes = "parts"  # each process's gradient a micro-batch of the window

    # A partial window cannot be applied as one of its own: each micro-batch
    # was folded into the moments with the window's size (1 / steps, and
    # the betas of kappa), so its end would weigh it short.
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
        # Set by a `PerDeviceGradients` model's compile (JAX): m and v then
        # hold one part per device (their sum is the moment), each device's
        # gradient a micro-batch (kappa = steps x devices).
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
        """True when every window is one micro-batch per replica (a constant
        `steps=1`): the fold then needs no window-start flag."""
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
        """(steps, 1 - beta_1,k, 1 - beta_2,k) of the current window: Python
        numbers with a constant `steps`, else float32 tensors."""
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
        """Once per window: (lr_k, sqrt(1 - P_2) / (1 - P_1)) after folding
        this window's betas into P_1, P_2 (kept where `keep` holds)."""
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
            # A schedule written for kappa = 1 sees the micro-batches consumed
            # over all replicas before this window.
            window = ops.cast(self.window_steps, _backend.INT)
            before = (ops.convert_to_tensor(self._window.micro_step) - window) * replicas
            learning_rate = schedule(before)
        else:
            learning_rate = self.learning_rate
        # lr_k = kappa_k * lr
        return ops.cast(learning_rate, "float32") * kappa, correction

    def _ema_momentum_of_window(self, replicas=1):
        """With a `scaling_rule`, window k's EMA momentum rho_k =
        ema_momentum ** kappa_k (a fixed rate per example); None (Keras's
        own `ema_momentum`) without one."""
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
        """((keep_1, keep_2), (take_1, take_2)) of one micro-batch, for every
        variable: keep_i = 1 - first (1 - beta_i,k) (`first` is 1 at a
        window's first micro-batch, else 0: the window's decay, as a factor),
        take_1 = (1 - beta_1,k) / steps and take_2 = (1 - beta_2,k)
        square_factor, square_factor = replicas / steps (g_j / kappa and
        g_j**2 / kappa with the replica factor of g = g_r / replicas undone
        before squaring). Numbers or tensors, alike."""
        keep = (1.0 - first * rate_1, 1.0 - first * rate_2)
        return keep, (rate_1 / steps, rate_2 * square_factor)

    @staticmethod
    def increments(g, take, times=operator.mul):
        """What one micro-batch's gradient adds to m and v: (g take_1,
        g**2 take_2). The fold is affine in (m, v), so a driver may add these
        to the rows a sparse gradient touches. `times` multiplies a gradient
        term by its factor (TensorFlow passes `multiply_no_nan`, so that a
        skipped micro-batch's NaN times its take of 0 is 0)."""
        take_1, take_2 = take
        return times(g, take_1), times(ops.square(g), take_2)

    @staticmethod
    def fold(m, v, g, keep, take, times=operator.mul):
        """One micro-batch into one variable's moments: (m keep_1 + g take_1,
        v keep_2 + g**2 take_2)."""
        keep_1, keep_2 = keep
        change_m, change_v = InvariantAdam.increments(g, take, times)
        return m * keep_1 + change_m, v * keep_2 + change_v

    @staticmethod
    def step(m, v, alpha, epsilon):
        """alpha m / (sqrt(v) + epsilon): what the window's end subtracts
        from theta (after the decoupled weight decay)."""
        return equations.adam_step(m, v, alpha, epsilon)

    def alpha(self, learning_rate, correction, dtype):
        """The window's step size in `dtype`: Keras Adam's alpha at update
        count `correction`, or with a `scaling_rule` lr_k times the bias
        correction sqrt(1 - P_2) / (1 - P_1) (`_scaled_rate`)."""
        if self.scaling_rule is None:
            return self._adam_alpha(learning_rate, correction, dtype)
        return ops.cast(learning_rate * correction, dtype)

    def rate_and_correction(self, replicas=1, keep=True):
        """(learning rate, correction) of `alpha` for the window ending now:
        (lr, updates + 1), or with a `scaling_rule` `_scaled_rate`'s (which
        folds the window's betas into P_1, P_2 where `keep` holds)."""
        if self.scaling_rule is None:
            return self.learning_rate, _compat.update_counter(self) + 1
        return self._scaled_rate(replicas, keep)

    # -- how JAX and PyTorch write it (`keras_accum.drivers.portable`) ---------

    def _devices(self):
        """Devices (`PerDeviceGradients`) or PyTorch processes whose
        gradients are micro-batches of their own in this optimizer's m and
        v, else 1."""
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
        # Per device (`PerDeviceGradients`): each row of `grads` is its
        # device's share g_d / devices, folded into that device's part.
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
        # theta = decayed(theta) - alpha m / (sqrt(v) + epsilon), the step
        # written in theta's dtype
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
