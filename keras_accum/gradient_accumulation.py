"""Gradient accumulation around any Keras optimizer."""

import copy
from typing import Any

from keras import ops, optimizers, saving

from keras_accum import (
    _backend,
    _compat,
    _execution,
    _replicas,
    _tensors,
    base,
    equations,
    folds,
    kernels,
    nonfinite,
    portable,
    schedules,
    weighing,
)
from keras_accum._backend import tf


@saving.register_keras_serializable(package="keras_accum")
class GradientAccumulation(base.AccumulationOptimizer):
    r"""Averages micro-batch gradients over a window, then steps `optimizer`.

    For a window of micro-batches j with gradients g_j and weights w_j
    (item or token counts passed as ``apply(..., weight=w_j)``, 1 by
    default), at the end of the window:

    .. math::

        S = \sum_j w_j g_j, \qquad W = \sum_j w_j, \qquad
        \texttt{optimizer.apply}(S / W)

    With w_j the number of items, this is exactly one step of `optimizer` on
    the concatenated batch, also when the last micro-batch is short or the
    loss is masked (the mean of means would be wrong there).

    * The inner optimizer only runs at window ends, so its state, its
      `iterations`, weight decay, gradient clipping (`clipnorm`,
      `global_clipnorm`, `clipvalue`, applied to the window mean across all
      replicas), EMA and learning-rate schedules advance once per update.
    * Accumulators are float32 whatever the variables' dtype.
    * Under a `tf.distribute` strategy, the sums stay on each replica until
      the window ends; the inner optimizer's own all-reduce of `S_r / W` is
      then the only gradient communication of the window. With clipping
      configured, the window sum is reduced first so that the clip sees the
      global mean (one more reduction, still once per window).
    * Sparse gradients (`tf.IndexedSlices`, from `Embedding`) of a
      variable with 65,536 elements or more (`keras_accum._tensors.SPARSE_MIN_ELEMENTS`)
      stay sparse: each micro-batch's rows are added to S where they fall
      (the sum is dense; the window's mean handed to `optimizer` is dense).
      Smaller ones are made dense first.

    Example:
        One update of the inner optimizer per 4 micro-batches of 4:

        >>> import numpy as np, keras, keras_accum as ka
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=4)
        >>> model.compile(optimizer=optimizer, loss="mse")
        >>> _ = model.fit(np.ones((32, 3)), np.zeros((32, 1)), batch_size=4, verbose=0)
        >>> int(optimizer.micro_step), int(optimizer.iterations)  # 8 micro-batches, 2 updates
        (8, 2)

    Args:
        optimizer: the `keras.optimizers.Optimizer` to step once per window.
        steps: micro-batches per window on each replica: an integer >= 1
            or a schedule (`keras_accum.PiecewiseSteps`, `AdaptiveSteps`).
        nonfinite: `"skip_window"` (default: a window whose sums hold a NaN
            or an Inf is dropped, as the big batch would be; checked once
            per window), `"skip_micro_batch"` (leaves the bad micro-batch
            out and averages the rest; one more read of every gradient per
            micro-batch), `"raise"` or None; see `keras_accum.nonfinite`.
        name: optimizer name.
    """

    _checks_window_sums = True  # "skip_window": see `_read_window`
    takes_weights = True

    def __init__(
        self,
        optimizer: optimizers.Optimizer,
        steps: Any = 1,
        nonfinite: str | None = "skip_window",
        name: str | None = None,
    ):
        if not isinstance(optimizer, optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a `keras.optimizers.Optimizer` instance. "
                f"Received: optimizer={optimizer!r}"
            )
        if isinstance(optimizer, base.AccumulationOptimizer):
            raise ValueError(
                "`optimizer` already accumulates micro-batches; wrapping it "
                f"again would nest windows. Received: optimizer={optimizer!r}"
            )
        if isinstance(optimizer, optimizers.LossScaleOptimizer):
            raise ValueError(
                "`optimizer` is a `LossScaleOptimizer`: it would unscale "
                "the accumulated window at the wrong moment. Put the loss "
                "scaler outside: LossScaleOptimizer(GradientAccumulation(...)) "
                "(what `model.compile` does under mixed_float16). "
                f"Received: optimizer={optimizer!r}"
            )
        if optimizer.gradient_accumulation_steps:
            raise ValueError(
                "`optimizer` has Keras's own `gradient_accumulation_steps`="
                f"{optimizer.gradient_accumulation_steps}; use `steps` here "
                "instead."
            )
        super().__init__(learning_rate=0.0, steps=steps, nonfinite=nonfinite, name=name)
        self.inner_optimizer = optimizer
        self._fit_items = None  # `weigh_micro_batches`: see `fit_items`

    def fit_items(self) -> weighing.FitItems:
        """The replica-local item count `weigh_micro_batches` writes under
        `model.fit` and `apply` reads when it is given no `weight` (created
        on first call, under this optimizer's strategy)."""
        if self._fit_items is None and not _backend.IS_TENSORFLOW:
            self._fit_items = weighing.FitItems()
        if self._fit_items is None:
            with _compat.optimizer_strategy(self).scope():
                self._fit_items = weighing.FitItems()
        return self._fit_items

    def _default_weight(self):
        # Under `weigh_micro_batches`: the count its loss recorded this step.
        return None if self._fit_items is None else self._fit_items.take()

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators = [
            self.add_local_variable(v.shape, "float32", "accumulator", reference=v)
            for v in var_list
        ]
        self._weight = self.add_local_variable((), "float32", "weight")
        self.inner_optimizer.build(var_list)
        self._restore_deferred_state()

    # EMA of the weights is the inner optimizer's (it runs at the inner
    # step, once per window). The wrapper shows it as its own once built, so
    # that code that looks for it on the compiled optimizer, or one level
    # below a `LossScaleOptimizer` (Keras's `SwapEMAWeights`), finds it; not
    # while Keras's `build` runs, which would make averages of its own.

    @property
    def use_ema(self):
        inner = getattr(self, "inner_optimizer", None)
        return bool(self.built and inner is not None and inner.use_ema)

    @use_ema.setter
    def use_ema(self, value):
        if value:  # Keras's constructor sets it to False
            raise ValueError(
                "Set `use_ema` on the wrapped optimizer: GradientAccumulation("
                "keras.optimizers.AdamW(..., use_ema=True)). Received: use_ema=True"
            )

    @property
    def _model_variables_moving_average(self):
        return _compat.ema_averages(self.inner_optimizer)

    def __dir__(self):
        # The inner optimizer's state is part of this one's (`variables`):
        # Keras's saving, which visits what `dir` lists, must not save and
        # load it a second time on its own (it would warn that it skips the
        # variables of the inner optimizer, unbuilt before the first step,
        # that this one restores when built).
        return [name for name in super().__dir__() if name != "inner_optimizer"]

    @property
    def variables(self):
        return _compat.own_variables(self) + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self._warn_pending_window()
        self.inner_optimizer.finalize_variable_values(var_list)

    def _fold(self, grads, variables, weight, start):
        # Replica context, replica-local state only: no communication.
        accumulators = self._accumulators_of(variables)
        scale, share = self._weights(weight)
        # A large Embedding's gradient stays sparse (`tf.IndexedSlices`): it
        # is added to S_r row by row, never made parameter-sized.
        grads = [_tensors.sparse_or_dense(g, v) for g, v in zip(grads, variables)]
        grads = [_tensors.map_values(lambda x: tf.cast(x, "float32"), g) for g in grads]
        xla = _execution.in_xla()
        if self.nonfinite == "skip_window":
            ok = None  # graph mode: the window's sums are checked at its end
            if xla:
                # Under XLA the check fuses into the fold; a bad micro-batch
                # adds zeros to S_r (kept finite) and NaN to W_r, which the
                # window's end then reads as "drop" (a scalar, no read of S_r).
                finite = nonfinite.all_finite(grads)
                keep = lambda x: tf.where(finite, x, tf.zeros((), x.dtype))
                grads = [_tensors.map_values(keep, g) for g in grads]
                share = tf.where(finite, share, tf.constant(float("nan"), "float32"))
        else:
            grads, ok = self._screen(grads, mask=xla)
            if ok is not None and xla:
                # A skipped micro-batch (zeroed by `_screen`) adds no weight.
                share = share * tf.cast(ok, "float32")
        if scale is not None:
            grads = [_tensors.map_values(lambda x: scale * x, g) for g in grads]

        def fold(start, ok):
            # S_r = w g at the window's start, else S_r + w g; W_r likewise
            # with w. A skipped micro-batch (ok False) adds nothing, and
            # leaves S_r = 0, W_r = 0 at the window's start.
            for a, wg in zip(accumulators, grads):
                folds.window_sum(a, wg if ok else None, start)
            folds.window_sum(self._weight, share if ok else None, start)

        _execution.by_condition(fold, start, None if xla else ok)

    def _weights(self, weight):
        """(scale of g, share of W_r) for this replica: w g is this
        replica's summed-loss gradient (scale None for w = 1), and the
        shares of the replicas sum to the micro-batch's weight."""
        replicas = _replicas.count()
        if isinstance(weight, weighing.ReplicaItems):
            # g = (mean gradient over this replica's n items) / replicas, so
            # its summed-loss gradient is n * replicas * g; W counts items.
            # n = UNSET (no count recorded this step: the model was compiled
            # again without weighing) counts the micro-batch as one; n = 0
            # (every item weighs zero) adds nothing.
            items = tf.cast(weight.items, "float32")
            recorded = items >= 0.0
            return (
                tf.where(recorded, items * replicas, 1.0),
                tf.where(recorded, items, 1.0 / replicas),
            )
        # g is this replica's share of the global mean over `weight` items,
        # so weight * g is its summed-loss gradient. W_r gets an equal share.
        scale = tf.cast(weight, "float32")
        unit = isinstance(weight, float) and weight == 1.0
        return None if unit else scale, scale / replicas

    def _read_window(self, variables):
        """((W,), ok): W summed over replicas; whether the window may be
        applied, under each policy."""
        if self.nonfinite != "skip_window":
            total_weight = _replicas.read_total(self._weight)
            if self.nonfinite == "skip_micro_batch":
                # Every micro-batch of the window skipped: nothing to apply.
                return (total_weight,), total_weight > 0.0
            return (total_weight,), None
        if _execution.in_xla():
            total_weight = _replicas.read_total(self._weight)
            # Under XLA a bad micro-batch made W NaN (`_fold`).
            return (total_weight,), tf.math.is_finite(total_weight)
        # Graph mode: NaN and Inf propagate into the window's sums, so one
        # check of each S_r per window (in the window end's branch) replaces
        # a check of every micro-batch, reduced with W in the window's one
        # scalar reduction.
        accumulators = self._accumulators_of(variables)

        def local():  # (W_r, 1.0 where S_r holds a NaN or an Inf)
            finite = nonfinite.all_finite([a.value for a in accumulators])
            return tf.stack([self._weight.value, 1.0 - tf.cast(finite, "float32")])

        totals = _replicas.sum_scalars(_replicas.for_each_replica(local))
        return (totals[0],), tf.equal(totals[1], 0.0)

    def _drop_window(self, variables, dropped=None):
        if self.nonfinite != "skip_window":
            return  # the sums are finite: bad micro-batches never entered
        accumulators = self._accumulators_of(variables)

        def reset():  # no NaN left behind (the next window overwrites them)
            if not _execution.in_xla():  # the drop branch of a `cond`: S_r may hold NaN
                for a in accumulators + [self._weight]:
                    folds.window_sum(a, None, True)
            elif dropped is None:  # XLA, a `cond` (replicas): S_r stayed finite
                self._weight.assign(0.0)
            else:  # XLA, every micro-step: W_r is NaN after a bad micro-batch
                self._weight.assign(tf.where(dropped, 0.0, self._weight.value))

        _replicas.for_each_replica(reset)

    def _accumulators_of(self, variables):
        return [self._accumulators[_compat.variable_index(self, v)] for v in variables]

    def _update(self, variables, window, writes):
        (total_weight,) = window
        # W = 0 only when every item of the window weighs zero: then S = 0
        # too, and the big batch's mean gradient is 0 (Keras divides its
        # loss with `divide_no_nan`), not 0 / 0.
        total_weight = tf.where(tf.equal(total_weight, 0.0), 1.0, total_weight)
        accumulators = self._accumulators_of(variables)
        inner = self.inner_optimizer
        clips = inner.clipnorm or inner.global_clipnorm or inner.clipvalue
        if _replicas.count() > 1 and clips:
            # The clip must see the global window mean: reduce it here, hand
            # it whole to replica 0 and zeros to the others, so that the inner
            # optimizer's per-replica clip then all-reduce (SUM) yields
            # exactly clip(S / W) on every replica.
            means = [_replicas.read_total(a) / total_weight for a in accumulators]

            def apply_inner(means):
                first = _replicas.is_first_replica()
                inner.apply([tf.where(first, m, tf.zeros((), m.dtype)) for m in means], variables)

            _replicas.for_each_replica(apply_inner, means)
        else:
            # Each replica hands S_r / W; the inner optimizer's all-reduce
            # (SUM) turns it into S / W: one communication per window.
            def apply_inner(total_weight):
                inner.apply([a.value / total_weight for a in accumulators], variables)

            _replicas.for_each_replica(apply_inner, total_weight)

    # -- JAX and PyTorch (`keras_accum.portable`) ----------------------------

    _portable_steps_inner = True

    def _portable_fold(self, grads, variables, weight, start, ok):
        accumulators = self._accumulators_of(variables)
        grads = [ops.cast(g, "float32") for g in grads]
        if isinstance(weight, weighing.ReplicaItems):  # `weigh_micro_batches`
            # n = UNSET (no count recorded this step) counts the micro-batch
            # as one; n = 0 (every item weighs zero) adds nothing.
            items = ops.cast(weight.items, "float32")
            weight = ops.where(items >= 0.0, items, 1.0)
        share = ops.convert_to_tensor(1.0 if weight is None else weight, "float32")
        if self.nonfinite == "skip_window" and portable.EAGER:
            pass  # NaN and Inf propagate into S: checked once, at the window's end
        elif self.nonfinite == "skip_window":
            # Traced (JAX): a bad micro-batch adds zeros to S (kept finite)
            # and NaN to W, which the window's end reads as "drop" (a
            # scalar, not a read of S on every micro-step).
            ok = portable.all_finite(grads)
            share = portable.masked(ok, share, ops.convert_to_tensor(float("nan"), "float32"))
        if ok is False:
            # Eager: a skipped micro-batch adds nothing (and no weight); the
            # window's start still resets S and W.
            if start is True:
                for a in accumulators:
                    a.assign(ops.zeros_like(a))
            # "skip_window": W = NaN (`share`), and the window is dropped at its end.
            added = share if self.nonfinite == "skip_window" else ops.zeros_like(share)
            self._weight.assign(equations.window_sum(self._weight, added, start))
            return
        if ok is not True:  # JAX: the same as a mask
            grads = [ops.where(ok, g, ops.zeros_like(g)) for g in grads]
            if self.nonfinite != "skip_window":
                share = share * ops.cast(ok, "float32")
        if weight is not None:
            scale = ops.convert_to_tensor(weight, "float32")
            grads = [scale * g for g in grads]
        # S = w g at the window's start, else S + w g; W likewise with w.
        kernels.window_sums(accumulators, grads, start)
        self._weight.assign(equations.window_sum(self._weight, share, start))

    def _portable_window_ok(self, boundary):
        if self.nonfinite == "skip_window" and portable.EAGER:
            # Eager, at the window's end only: its sums hold a NaN or an Inf
            # when any of its micro-batches did.
            return portable.all_finite([ops.convert_to_tensor(a) for a in self._accumulators])
        if self.nonfinite == "skip_window":
            return ops.isfinite(ops.convert_to_tensor(self._weight))
        if self.nonfinite == "skip_micro_batch":
            return self._weight > 0.0  # every micro-batch skipped: nothing to apply
        return True

    def _portable_drop(self, dropped):
        # A bad micro-batch made W NaN (traced) or S (eager): 0 again, so
        # no NaN is left behind.
        self._weight.assign(portable.masked(dropped, 0.0, self._weight))
        if dropped is True:
            for a in self._accumulators:
                a.assign(ops.zeros_like(a))

    def _portable_update(self, variables, keep):
        weight = ops.convert_to_tensor(self._weight)
        weight = ops.where(ops.equal(weight, 0.0), 1.0, weight)  # S = 0 too: mean 0
        means = [a / weight for a in self._accumulators_of(variables)]
        if isinstance(keep, bool) or _backend.is_concrete(keep):
            if bool(keep):  # PyTorch, or JAX run eagerly
                self.inner_optimizer.apply(means, variables)
            return
        pending = self.__dict__.get("_pending_inner")
        if pending is None:
            raise RuntimeError(
                "GradientAccumulation in a traced JAX step must be applied "
                "through `stateless_apply` (what `model.fit` does)."
            )
        pending.extend([means, keep])  # stepped in `stateless_apply`

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
        return portable.stateless_inner_step(
            self, optimizer_variables, grads, trainable_variables, weight
        )

    def _finish_update(self, variables):
        pass  # the inner optimizer applies its EMA and constraints itself

    def _wrapped_optimizers(self):
        return [self.inner_optimizer]

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": saving.serialize_keras_object(self.inner_optimizer),
            "steps": schedules.serialize_steps(self.steps),
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Keras's optimizer table, not the saved class path: under PyTorch a
        # `keras.optimizers.Adam` is saved as Keras's PyTorch subclass, which
        # another backend must load as its own.
        # (It lowercases the class name in place: a copy keeps `config` as given.)
        inner = copy.deepcopy(config.pop("optimizer"))
        optimizer = optimizers.deserialize(inner, custom_objects=custom_objects)
        return cls(optimizer, **config)
