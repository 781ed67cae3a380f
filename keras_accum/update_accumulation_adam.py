"""Update-accumulation Adam: moments every micro-batch, parameters every N."""

from typing import Any

import tensorflow as tf
from keras import saving

from keras_accum import base, fused, schedules
from keras_accum.adam_family import AdamFamily


@saving.register_keras_serializable(package="keras_accum")
class UpdateAccumulationAdam(AdamFamily):
    """Adam whose moments see every micro-batch; parameters move every N.

    For every micro-step t (t counts micro-batches whose gradient was used;
    under a strategy g_t is the replica-mean gradient of that step):

        m_t = m + (g_t - m) * (1 - beta_1)
        v_t = v + (g_t**2 - v) * (1 - beta_2)
        A   = A + alpha_t * m_t / (sqrt(v_t) + epsilon)
              alpha_t = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
        every `steps` micro-steps:  theta = theta - A ;  A = 0

    Gradients within a window are all taken at the same (stale) theta: this
    is Adam with a bounded delay of up to `steps - 1` micro-steps.

    **Learning rate.** The applied step is the *sum* of `steps` Adam steps,
    about `steps x learning_rate` in size. A learning rate tuned for plain
    Adam at the micro-batch size transfers unchanged here as a
    per-micro-batch rate; it is *not* a per-update rate, and should not be
    scaled up with `steps`. A schedule is evaluated at the update count.

    Memory: Adam's two moments plus one parameter-sized buffer A (none when
    `steps=1`, which is exactly `keras.optimizers.Adam`).

    `nonfinite="skip_micro_batch"` leaves a non-finite micro-step out of the
    moments (on all replicas, since they share them); `"skip_window"` also
    drops the window's accumulated update A. `weight_decay` is decoupled and
    applied once per update. Keras's `clipnorm`, `clipvalue` and
    `global_clipnorm` clip each micro-step gradient (Adam runs per
    micro-step); `use_ema` and variable constraints act once per update;
    `overwrite_with_gradient` variables take the last micro-batch's gradient
    at the window's end.

    Args:
        learning_rate: float, schedule (sees the update count) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-steps per update: an integer >= 1 or a schedule
            (`keras_accum.PiecewiseSteps`, `keras_accum.AdaptiveSteps`).
        nonfinite: `"skip_micro_batch"`, `"skip_window"`, `"raise"` or None.
        weight_decay: optional decoupled weight decay.
        name: optimizer name.
    """

    def __init__(self, *args: Any, name: str = "update_accumulation_adam", **kwargs: Any):
        super().__init__(*args, name=name, **kwargs)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._moment_steps = self.add_variable(
            (),
            dtype="int64",
            aggregation="only_first_replica",
            name="moment_steps",
        )
        # No buffer A when every window is one micro-step (plain Adam).
        buffered = schedules.steps_range(self.steps)[1] > 1
        slots = ["momentum", "velocity"] + (["update"] if buffered else [])
        slots = self.add_optimizer_variables(var_list, slots)
        self._momentums, self._velocities = slots[0], slots[1]
        self._updates = slots[2] if buffered else None
        self._restore_deferred_state()

    def _accumulate(self, distribution, grads, variables, weight, start):
        # Moments are shared: reduce the gradient every micro-step (SUM of the
        # replicas' shares is the replica-mean gradient).
        reduced = self._reduce(distribution, grads, variables)
        # Every replica now holds the same micro-step gradient: screen and
        # clip it on each (each counts the skip of its own micro-batch).
        graph = not base.in_xla()  # branches in graph mode, masks under XLA
        reduced, ok = distribution.extended.call_for_each_replica(
            self._prepare, args=(reduced, variables, not graph)
        )
        ok = (
            None
            if self.nonfinite in (None, "raise")
            else distribution.experimental_local_results(ok)[0]
        )
        # t = micro-steps folded into the moments so far (a skip adds none)
        t = self._moment_steps.assign_add(1 if ok is None else tf.cast(ok, "int64"))
        learning_rate = self.learning_rate

        def step(keep):
            if graph and self._updates is not None and keep is None:
                # Graph mode: one compiled kernel per replica for every
                # variable (TensorFlow ops would be a full pass per term);
                # on a small model, where the launch costs more (see
                # `fused`), the same arithmetic op by op, alpha computed once.
                jit = fused.worth_compiling(variables)
                distribution.extended.call_for_each_replica(
                    self._fused_micro_step, args=(reduced, variables, learning_rate, t, start, jit)
                )
                return
            for g, var in zip(reduced, variables):
                distribution.extended.update(
                    var.value,
                    self._micro_update,
                    args=(g, learning_rate, t, start, keep),
                    group=False,
                )

        if not graph or ok is None:
            step(ok)
            return

        def skip():  # m, v, theta unchanged; A = 0 at the window's start
            if self._updates is not None:
                updates = [self._updates[self._get_variable_index(v)] for v in variables]

                def restart():
                    for update in updates:
                        update.assign(base.zeros_like_state(update))

                tf.cond(start, restart, lambda: None)

        tf.cond(ok, lambda: step(None), skip)

    def _reduce(self, distribution, grads, variables):
        """SUM over replicas. A tensor that every replica handed in (not a
        per-replica value) sums to replicas x itself."""
        grads = [base.dense(g) for g in grads]
        replicas = distribution.num_replicas_in_sync
        split = [isinstance(g, tf.distribute.DistributedValues) for g in grads]
        pairs = [(g, v.value) for g, v, s in zip(grads, variables, split) if s]
        summed = iter(
            distribution.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)
            if pairs
            else []
        )
        return [
            next(summed) if s else g * replicas if replicas > 1 else g for g, s in zip(grads, split)
        ]

    def _prepare(self, grads, variables, mask=True):
        grads = [tf.cast(g, v.dtype) for g, v in zip(grads, variables)]
        grads, ok = self._screen(grads, mask=mask)
        grads = self._clip_micro_batch(grads, 1)
        return grads, (tf.constant(True) if ok is None else ok)

    def _fused_micro_step(self, grads, variables, learning_rate, t, start, jit=True):
        """`_micro_update` of every variable as one compiled kernel (with
        `jit` False, its arithmetic op by op), in replica context: each
        replica updates its own copy of the (mirrored) state with the same
        reduced gradient, as `extended.update` would."""
        handles = []
        for var in variables:
            index = self._get_variable_index(var)
            slots = (self._momentums, self._velocities, self._updates)
            handles.append(tuple(slot[index].handle for slot in slots))
        # alpha_t with t = micro-steps folded into the moments so far
        alpha = self._adam_alpha(learning_rate, tf.maximum(t, 1), "float32")
        rates = [tf.constant(x, "float32") for x in (1 - self.beta_1, 1 - self.beta_2)]
        scalars = (alpha, start, *rates, tf.constant(self.epsilon, "float32"))
        # `grads` come from `_prepare`: cast, screened and clipped.
        fused.run(fused.adam_micro_step, self, grads, handles, scalars, jit=jit)

    def _micro_update(self, variable, gradient, learning_rate, t, start, ok):
        """One variable's micro-step with TensorFlow ops: under XLA (masks,
        fused by the caller's compilation) and when no buffer A exists."""
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        lr = tf.cast(learning_rate, variable.dtype)
        keep = None if ok is None else tf.cast(ok, variable.dtype)
        # alpha_t uses t = micro-steps folded into the moments so far (>= 1,
        # also before the first finite one).
        alpha = self._adam_alpha(learning_rate, tf.maximum(t, 1), variable.dtype)
        dm = (gradient - m) * (1 - self.beta_1)
        dv = (tf.square(gradient) - v) * (1 - self.beta_2)
        if keep is not None:  # a skipped micro-step leaves m and v as they are
            dm, dv = dm * keep, dv * keep
        self.assign_add(m, dm)
        self.assign_add(v, dv)
        adam_step = (m * alpha) / (tf.sqrt(v) + self.epsilon)
        if keep is not None:
            adam_step = adam_step * keep
        if self._updates is None:
            self._decay(variable, lr if keep is None else lr * keep)
            self.assign_sub(variable, adam_step)
            return
        update = self._updates[index]
        # A = step at the window's first micro-step (whatever came before,
        # also when that micro-step is skipped), else A + step
        update.assign(tf.where(start, adam_step, update + adam_step))

    def _update(self, distribution, variables, window):
        if self._updates is None:  # steps == 1: applied in the micro-step
            return
        learning_rate = self.learning_rate
        for var in variables:
            update = self._updates[self._get_variable_index(var)]

            def apply_update(variable, update):
                self._decay(variable, tf.cast(learning_rate, variable.dtype))
                # theta = theta - A
                self.assign_sub(variable, update)

            distribution.extended.update(var.value, apply_update, args=(update.value,), group=False)
