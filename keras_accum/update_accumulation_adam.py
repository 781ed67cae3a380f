"""Update-accumulation Adam: moments every micro-batch, parameters every N."""

import tensorflow as tf
from keras import saving

from keras_accum import base, schedules


@saving.register_keras_serializable(package="keras_accum")
class UpdateAccumulationAdam(base.AdamFamily):
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
    applied once per update.

    Args:
        learning_rate: float, schedule (sees the update count) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-steps per update: an integer >= 1 or a schedule
            (`keras_accum.PiecewiseSteps`, `keras_accum.AdaptiveSteps`).
        nonfinite: `"skip_micro_batch"`, `"skip_window"`, `"raise"` or None.
        weight_decay: optional decoupled weight decay.
        name: optimizer name.
    """

    def __init__(self, *args, name="update_accumulation_adam", **kwargs):
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

    def _accumulate(self, distribution, grads, variables, weight, start):
        # Moments are shared: reduce the gradient every micro-step (SUM of the
        # replicas' shares is the replica-mean gradient).
        reduced = distribution.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM,
            [(base.dense(g), v.value) for g, v in zip(grads, variables)],
        )

        def step():
            t = self._moment_steps.assign_add(1)
            learning_rate = self.learning_rate
            for g, var in zip(reduced, variables):
                distribution.extended.update(
                    var.value,
                    self._micro_update,
                    args=(g, learning_rate, t, start),
                    group=False,
                )

        if self.nonfinite is None:
            step()
            return
        local = [distribution.experimental_local_results(g)[0] for g in reduced]
        if self.nonfinite == "raise":
            with tf.control_dependencies(
                [
                    tf.debugging.check_numerics(
                        g, f"{self.name}: non-finite gradient (nonfinite='raise')"
                    )
                    for g in local
                ]
            ):
                step()
            return

        def skip():
            # Every replica's micro-batch of this step is dropped.
            def mark():
                self._skipped_micro_batches.assign_add(1)
                if self.nonfinite == "skip_window":
                    self._window_bad.assign_add(1)

            distribution.extended.call_for_each_replica(mark)

        tf.cond(base.all_finite(local), step, skip)

    def _micro_update(self, variable, gradient, learning_rate, t, start):
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        gradient = tf.cast(gradient, variable.dtype)
        lr = tf.cast(learning_rate, variable.dtype)
        # alpha_t uses t = micro-steps folded into the moments so far.
        alpha = self._adam_alpha(learning_rate, t, variable.dtype)
        self.assign_add(m, (gradient - m) * (1 - self.beta_1))
        self.assign_add(v, (tf.square(gradient) - v) * (1 - self.beta_2))
        adam_step = (m * alpha) / (tf.sqrt(v) + self.epsilon)
        if self._updates is None:
            self._decay(variable, lr)
            self.assign_sub(variable, adam_step)
            return
        update = self._updates[index]
        # A = adam_step at the window's first micro-step, else A + adam_step
        tf.cond(
            start,
            lambda: update.assign(adam_step),
            lambda: update.assign_add(adam_step),
        )

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
