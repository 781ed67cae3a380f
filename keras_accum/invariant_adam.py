"""Batch-size invariant Adam (Wang & Aitchison 2024, arXiv:2402.18824)."""

import tensorflow as tf
from keras import saving

from keras_accum import base
from keras_accum.adam_family import AdamFamily


@saving.register_keras_serializable(package="keras_accum")
class InvariantAdam(AdamFamily):
    """Adam whose second moment averages *squared* micro-batch gradients.

    With kappa micro-batches per update (kappa = steps x replicas in sync)
    and micro-batch mean gradients g_j, update k does:

        m = beta_1 * m + (1 - beta_1) * (1/kappa) * sum_j g_j
        v = beta_2 * v + (1 - beta_2) * (1/kappa) * sum_j g_j**2
        alpha_k = lr * sqrt(1 - beta_2**k) / (1 - beta_1**k)
        theta = theta - alpha_k * m / (sqrt(v) + epsilon)

    Standard accumulation squares the averaged gradient, and
    E[(mean g)^2] = |G|^2 + sigma^2/kappa depends on kappa; here
    E[mean(g^2)] = |G|^2 + sigma^2 does not. Holding the micro-batch size
    fixed and scaling `learning_rate` and `1 - beta_i` linearly with kappa
    (`keras_accum.scale_hyperparameters(rule="invariant")`), training curves
    versus examples seen stay the same when kappa changes (for small enough
    learning rates).

    No buffer beyond Adam's two moments: each micro-batch is folded into m
    and v as it arrives (the first of a window also applies the decay), and
    only the last one moves theta. Under `tf.distribute`, every replica's
    gradient is a micro-batch and is squared before the cross-replica mean;
    m and v are replica-local sums that are reduced once per window.

    Conventions:
    * epsilon sits outside the square root as in `keras.optimizers.Adam`, so
      that `steps=1` on one replica is exactly Keras Adam. The authors' code
      (github.com/xidulu/batch_size_invariant_adamW) puts it inside
      (`sqrt(v + eps)`, eps=1e-16).
    * Gradients arrive in the Keras convention (each replica's share of the
      global mean, i.e. g_r / replicas); the factor is undone before
      squaring, which assumes equal micro-batches on all replicas.
    * `nonfinite="skip_micro_batch"` counts a non-finite micro-batch as a
      zero gradient in its window's averages (the fold cannot renormalise
      without extra buffers); `"skip_window"` is therefore not offered.
    * `weight_decay` is decoupled (AdamW style), applied once per update.
    * Keras's `clipnorm`, `clipvalue` and `global_clipnorm` clip each
      micro-batch's gradient before it enters m and v (the global norm is
      over that micro-batch's gradients on its replica); `use_ema` and
      variable constraints act once per update; `loss_scale_factor`
      unscales every micro-batch; `overwrite_with_gradient` variables take
      the last micro-batch's gradient at the window's end. With `steps=1` on
      one replica all of these equal `keras.optimizers.Adam`.

    Args:
        learning_rate: float, schedule (sees the update count) or callable.
        beta_1, beta_2, epsilon: as in `keras.optimizers.Adam`.
        steps: micro-batches per update on each replica (integer >= 1).
        nonfinite: `"skip_micro_batch"`, `"raise"` or None.
        weight_decay: optional decoupled weight decay.
        name: optimizer name.
    """

    def __init__(self, *args, name="invariant_adam", **kwargs):
        if kwargs.get("nonfinite") == "skip_window":
            raise ValueError(
                "InvariantAdam folds each micro-batch into its moments and "
                "cannot drop a window afterwards; use 'skip_micro_batch' or "
                "'raise'. Received: nonfinite='skip_window'"
            )
        super().__init__(*args, name=name, **kwargs)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = [], []
        for var in var_list:
            self._momentums.append(
                self.add_local_variable(var.shape, var.dtype, "momentum", reference=var)
            )
            self._velocities.append(
                self.add_local_variable(var.shape, var.dtype, "velocity", reference=var)
            )

    def _accumulate(self, distribution, grads, variables, weight, start):
        distribution.extended.call_for_each_replica(self._fold, args=(grads, variables, start))

    def _fold(self, grads, variables, start):
        # Replica context, replica-local moments: no communication.
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        moments = [
            (self._momentums[i], self._velocities[i])
            for i in map(self._get_variable_index, variables)
        ]
        grads = [tf.cast(base.dense(g), m.dtype) for g, (m, _) in zip(grads, moments)]
        if not base.in_xla():
            self._fold_graph(grads, moments, replicas, start)
            return
        # A skipped micro-batch comes back as zeros: it counts as a zero
        # gradient, and the window's decay of m and v still happens.
        grads, _ = self._screen(grads)
        grads = self._clip_micro_batch(grads, replicas)
        first = tf.cast(start, grads[0].dtype) if self.steps > 1 else 1.0
        self._fold_moments(grads, moments, replicas, first)

    def _fold_moments(self, grads, moments, replicas, first):
        """m += (1 - beta_1) (g_j / kappa - first m), v likewise with the
        squares; `first` is 1 at the window's first micro-batch, else 0."""
        for g, (m, v) in zip(grads, moments):
            # Micro-batch j of the window contributes g_j / kappa to the
            # mean gradient; with g = g_r / replicas that is g / steps.
            mean_part = g if self.steps == 1 else g / self.steps
            # ... and g_j**2 / kappa = g**2 * replicas / steps to the mean
            # squared gradient (the replica factor undone before squaring).
            square_part = tf.square(g)
            if replicas != self.steps:
                square_part = square_part * (replicas / self.steps)
            if isinstance(first, float):  # Python 1.0 or 0.0: fewer ops.
                if first:
                    # m = beta_1 m + (1 - beta_1) g_j / kappa (Keras's form)
                    self.assign_add(m, (mean_part - m) * (1 - self.beta_1))
                    self.assign_add(v, (square_part - v) * (1 - self.beta_2))
                else:
                    # m += (1 - beta_1) g_j / kappa
                    self.assign_add(m, mean_part * (1 - self.beta_1))
                    self.assign_add(v, square_part * (1 - self.beta_2))
            else:
                # m += (1 - beta_1) (g_j / kappa - [window start] m)
                self.assign_add(m, (mean_part - first * m) * (1 - self.beta_1))
                self.assign_add(v, (square_part - first * v) * (1 - self.beta_2))

    def _fold_graph(self, grads, moments, replicas, start):
        """`_fold` in graph mode: the same arithmetic (x - 0 m = x exactly),
        with branches instead of masks (a `cond` is free there, a mask a
        full pass)."""
        grads, ok = self._screen(grads, mask=False)
        zeros = [tf.zeros((), g.dtype) for g in grads]

        def fold(first):
            clipped = self._clip_micro_batch(grads, replicas)
            self._fold_moments(clipped, moments, replicas, first)

        def skip(first):  # a zero gradient: only the window-start decay
            if first:
                self._fold_moments(zeros, moments, replicas, first)

        def either(first):
            if ok is None:
                fold(first)
            else:
                tf.cond(ok, lambda: fold(first), lambda: skip(first))

        if self.steps == 1:
            either(1.0)
        else:
            tf.cond(start, lambda: either(1.0), lambda: either(0.0))

    def _update(self, distribution, variables, window):
        learning_rate = self.learning_rate
        update_count = self._iterations + 1
        replicated = distribution.num_replicas_in_sync > 1
        for var in variables:
            index = self._get_variable_index(var)
            m, v = self._momentums[index], self._velocities[index]
            # Cross-replica read of the replica-local moments = their sum.
            m_total = base.read_total(m) if replicated else m.value
            v_total = base.read_total(v) if replicated else v.value
            distribution.extended.update(
                var.value,
                self._apply_moments,
                args=(m_total, v_total, learning_rate, update_count),
                group=False,
            )
            if replicated:
                # Spread the totals back evenly over the replicas.
                base.assign_total(m, m_total)
                base.assign_total(v, v_total)

    def _apply_moments(self, variable, m, v, learning_rate, update_count):
        alpha = self._adam_alpha(learning_rate, update_count, variable.dtype)
        self._decay(variable, tf.cast(learning_rate, variable.dtype))
        # theta = theta - alpha_k m / (sqrt(v) + epsilon)
        variable.assign_sub((m * alpha) / (tf.sqrt(v) + self.epsilon))
