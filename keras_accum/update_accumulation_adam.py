"""Update-accumulation Adam: moments every micro-batch, parameters every N."""

from typing import Any

from keras import ops, saving

from keras_accum import _backend, _compat, drivers, equations, kernels, schedules
from keras_accum.adam_family import AdamFamily


@saving.register_keras_serializable(package="keras_accum")
class UpdateAccumulationAdam(drivers.UpdateAccumulationAdamForm, AdamFamily):
    r"""Adam whose moments see every micro-batch; parameters move every N.

    For every micro-step t (t counts micro-batches whose gradient was used;
    under a strategy g_t is the replica-mean gradient of that step):

    .. math::

        m_t &= m + (g_t - m)(1 - \beta_1) \\
        v_t &= v + (g_t^2 - v)(1 - \beta_2) \\
        A &= A + \alpha_t \, m_t / (\sqrt{v_t} + \epsilon), \qquad
            \alpha_t = \mathrm{lr} \, \sqrt{1 - \beta_2^t} / (1 - \beta_1^t)

    and every `steps` micro-steps :math:`\theta \leftarrow \theta - A`,
    :math:`A \leftarrow 0`.

    Adam with a bounded delay of up to `steps - 1` micro-steps. The applied
    step is the *sum* of `steps` Adam steps: a learning rate tuned for plain
    Adam at the micro-batch size is used unchanged, not scaled with `steps`.
    With `steps=1` on one replica this is `keras.optimizers.Adam`, bit for
    bit, for dense gradients. Memory: one buffer A beyond Adam's moments
    (none when `steps=1`). See docs/ALGORITHMS.md and docs/guides/adam.md.

    Args:
        learning_rate: float, schedule (sees the update count) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-steps per update: an integer >= 1 or a schedule
            (`keras_accum.PiecewiseSteps`, `keras_accum.AdaptiveSteps`).
        nonfinite: `"skip_micro_batch"` (the micro-step is left out of the
            moments), `"skip_window"` (A is dropped too), `"raise"` or None.
        weight_decay: optional decoupled weight decay, once per update.
        state_dtype: the moments' dtype for a bfloat16 or float16 variable:
            "float32" (default) or None (the variable's own, as Keras's Adam).
        flush_last_window: True: where `fit` ends inside a window, A is
            applied then (`flush()`); False (default): it waits, with a warning.
        name: optimizer name.
    """

    # t of v's bias correction 1 - beta_2**t (`sharpness.adam_preconditioner`).
    _moments_counter = "micro_step"

    _across_processes = "gradients"  # its moments see every micro-batch's mean

    def __init__(self, *args: Any, name: str = "update_accumulation_adam", **kwargs: Any):
        super().__init__(*args, name=name, **kwargs)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._moment_steps = self.add_variable(
            (),
            dtype=_backend.INT,
            aggregation="only_first_replica",
            name="moment_steps",
        )
        # No buffer A when every window is one micro-step (plain Adam).
        buffered = schedules.steps_range(self.steps)[1] > 1
        names = ["momentum", "velocity"] + (["update"] if buffered else [])
        # Keras 3.10's `add_optimizer_variables` (3.5-3.9 lack it): slots interleaved
        # per variable (the saved order), None for `overwrite_with_gradient`.
        slots = tuple([] for _ in names)
        for var in var_list:
            overwrite = getattr(var, "overwrite_with_gradient", False)
            for slot, name in zip(slots, names):
                slot.append(None if overwrite else self._slot(var, name))
        self._momentums, self._velocities = slots[0], slots[1]
        self._updates = slots[2] if buffered else None
        self._restore_deferred_state()

    # -- the rule: pure functions of values, which every driver runs ----------

    @staticmethod
    def changes(m, v, g, rate_1, rate_2):
        """((g - m)(1 - beta_1), (g**2 - v)(1 - beta_2)); `rate_i` = 1 - beta_i."""
        return equations.adam_moment_changes(m, v, g, rate_1, rate_2)

    @staticmethod
    def step(m, v, alpha, epsilon):
        """alpha_t m_t / (sqrt(v_t) + epsilon): the micro-step's Adam step."""
        return equations.adam_step(m, v, alpha, epsilon)

    def alpha_dtype(self, dtype):
        """alpha_t's dtype: the moments' without a buffer (as Keras's Adam),
        else float32."""
        return dtype if self._updates is None else "float32"

    def alpha(self, count, dtype):
        """alpha_t = lr sqrt(1 - beta_2**t) / (1 - beta_1**t), `count` = t."""
        return self._adam_alpha(self.learning_rate, count, dtype)

    # -- how JAX and PyTorch write it (`keras_accum.drivers.portable`) ---------

    def _fold(self, grads, variables, weight, start, ok):
        # (A skipped micro-step comes as zeros, and `ok` keeps it out.)
        grads = [ops.cast(g, self._slot_dtype(v.dtype)) for g, v in zip(grads, variables)]
        grads = self._clip_micro_batch(grads, 1)
        # t = micro-steps folded into the moments so far (a skip adds none)
        t = ops.convert_to_tensor(self._moment_steps) + kernels.flag(ok, _backend.INT)
        self._moment_steps.assign(t)
        indices = [_compat.variable_index(self, var) for var in variables]
        momentums = [self._momentums[i] for i in indices]
        velocities = [self._velocities[i] for i in indices]
        rates = (1 - self.beta_1, 1 - self.beta_2)
        kernels.adam_moments(momentums, velocities, grads, *rates, ok, self.changes)
        count = ops.maximum(t, 1)
        alphas = {}  # alpha_t, once per dtype it is computed in
        for m in momentums:
            dtype = self.alpha_dtype(m.dtype)
            if dtype not in alphas:
                alphas[dtype] = ops.cast(self.alpha(count, dtype), m.dtype)
        alphas = [alphas[self.alpha_dtype(m.dtype)] for m in momentums]
        if self._updates is not None:
            # A = step at the window's start, else A + step (a skip adds 0).
            updates = [self._updates[i] for i in indices]
            kernels.add_adam_steps(updates, momentums, velocities, alphas, self.epsilon, start, ok)
            return
        # steps == 1: Keras's Adam, decay and step at once (a skip moves nothing).
        decays = [self._decay_of(var, self.learning_rate) for var in variables]
        steps = kernels.adam_steps(momentums, velocities, alphas, self.epsilon)
        kernels.subtract(variables, steps, ok, decays)

    def _window_state(self):
        return [a for a in self._updates or [] if a is not None]  # A

    def _update(self, variables, keep):
        if self._updates is None:  # steps == 1: applied in the micro-step
            return
        # theta = decayed(theta) - A
        updates = [self._updates[_compat.variable_index(self, var)] for var in variables]
        # (A float32 A of a bfloat16 variable is subtracted in float32.)
        deltas = [
            ops.cast(a, var.dtype) if a.dtype == var.dtype else ops.convert_to_tensor(a)
            for a, var in zip(updates, variables)
        ]
        learning_rate = self.learning_rate
        decays = [self._decay_of(var, learning_rate) for var in variables]
        kernels.subtract(variables, deltas, keep, decays)
