"""Gradient accumulation around any Keras optimizer."""

import copy
import warnings
from typing import Any

from keras import ops, optimizers, saving

from keras_accum import _compat, base, drivers, kernels, schedules, weighing


@saving.register_keras_serializable(package="keras_accum")
class GradientAccumulation(drivers.GradientAccumulationForm, base.AccumulationOptimizer):
    r"""Averages micro-batch gradients over a window, then steps `optimizer`.

    For a window of micro-batches j with gradients g_j and weights w_j
    (item or token counts passed as ``apply(..., weight=w_j)``, 1 by
    default), at the end of the window:

    .. math::

        S = \sum_j w_j g_j, \qquad W = \sum_j w_j, \qquad
        \texttt{optimizer.apply}(S / W)

    With w_j the item count this is one step of `optimizer` on the
    concatenated batch, even with a short or masked micro-batch. `optimizer`
    (its state, clipping, EMA, schedule) runs once per window; the float32
    sums stay on each replica until then. See docs/ALGORITHMS.md.

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
            or an Inf is dropped), `"skip_micro_batch"` (the bad micro-batch
            is left out), `"raise"` or None; see `keras_accum.nonfinite`.
        name: optimizer name.
        flush_last_window: True: where `fit` ends inside a window, its
            micro-batches are applied as a window of their own (`flush()`);
            False (default): they wait, with a warning.
    """

    _checks_window_sums = True  # "skip_window": the window's sums may be checked at its end
    _steps_inner = True  # the inner optimizer counts, averages and constrains
    _per_device_sums = True  # may keep each device's sums (`PerDeviceGradients`)
    _across_processes = "sums"  # S_r and W_r, all-reduced at the window's end
    takes_weights = True

    def __init__(
        self,
        optimizer: optimizers.Optimizer,
        steps: Any = 1,
        nonfinite: str | None = "skip_window",
        name: str | None = None,
        flush_last_window: bool = False,
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
        super().__init__(
            learning_rate=0.0,
            steps=steps,
            nonfinite=nonfinite,
            name=name,
            flush_last_window=flush_last_window,
        )
        self.inner_optimizer = optimizer
        self._fit_items = None  # `weigh_micro_batches`: see `fit_items`
        # Set by a `PerDeviceGradients` compile (JAX): the sums hold a row per device.
        self._device_route = None

    def fit_items(self) -> weighing.FitItems:
        """The replica-local item count `weigh_micro_batches` writes and
        `apply` reads when given no `weight` (created on first call)."""
        if self._fit_items is None:
            with self._creation_scope():  # the strategy's, under TensorFlow
                self._fit_items = weighing.FitItems()
        return self._fit_items

    def _default_weight(self):
        # Under `weigh_micro_batches`: the count its loss recorded this step.
        return None if self._fit_items is None else self._fit_items.take()

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        route = self._device_route
        self._accumulators = [
            self.add_local_variable(v.shape, "float32", "accumulator", reference=v)
            if route is None
            else route.add_variable(self, v, "accumulator")
            for v in var_list
        ]
        self._weight = self.add_local_variable((), "float32", "weight")
        self.inner_optimizer.build(var_list)
        self._warn_low_precision_slots()
        self._restore_deferred_state()

    def _warn_low_precision_slots(self):
        """Warns when the inner optimizer keeps slots in bfloat16 or float16."""
        low = {str(v.dtype) for v in self.inner_optimizer.variables} & {"bfloat16", "float16"}
        if low:
            warnings.warn(
                f"GradientAccumulation '{self.name}': the inner "
                f"{type(self.inner_optimizer).__name__} keeps its slots in "
                f"{', '.join(sorted(low))}, as the variables are (its moments may stall: "
                "beta_2 = 0.999 rounds to 1 in bfloat16). Train float32 variables (the "
                "'mixed_bfloat16' policy), or use keras_accum.InvariantAdam or "
                "UpdateAccumulationAdam, whose moments are float32 (`state_dtype`).",
                stacklevel=2,
            )

    # The EMA is the inner optimizer's; shown as the wrapper's once built (for
    # Keras's `SwapEMAWeights`), not during `build`, which would make its own.

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
        # The inner optimizer's state is in `variables`: Keras's saving, which
        # visits what `dir` lists, must not save it a second time.
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
        self._end_of_training()  # the flush (an inner step) or the warning
        self.inner_optimizer.finalize_variable_values(var_list)

    def _accumulators_of(self, variables):
        return [self._accumulators[_compat.variable_index(self, v)] for v in variables]

    # -- the rule: pure functions of values, which every driver runs ----------

    @staticmethod
    def weights(weight, replicas=1):
        """(scale, share) of one micro-batch on one replica: g scale (None: 1)
        is added to S, share to W. A weight w gives (w, w / replicas); a
        `ReplicaItems` count n (g the mean over n items / replicas) gives
        (n replicas, n), and UNSET (no count recorded) counts as one."""
        if isinstance(weight, weighing.ReplicaItems):
            items = ops.cast(weight.items, "float32")
            recorded = items >= 0.0
            scale = items if replicas == 1 else items * replicas
            return ops.where(recorded, scale, 1.0), ops.where(recorded, items, 1.0 / replicas)
        scale = ops.cast(weight, "float32")
        share = scale if replicas == 1 else scale / replicas
        return (None if isinstance(weight, float) and weight == 1.0 else scale), share

    @staticmethod
    def means(sums, total_weight):
        """[S / W], with 0 where W = 0 (every item weighed zero; S = 0 too)."""
        total_weight = ops.where(ops.equal(total_weight, 0.0), 1.0, total_weight)
        return [total / total_weight for total in sums]

    # -- how JAX and PyTorch write it (`keras_accum.drivers.portable`) ---------

    def _fold(self, grads, variables, weight, start, ok):
        # (A skipped micro-batch comes as zeros; "skip_window" may let a NaN through.)
        grads = [ops.cast(g, "float32") for g in grads]
        route = self._device_route
        if route is not None and isinstance(weight, weighing.ReplicaItems):
            # `weigh_micro_batches` on a row per device: each its own count.
            grads, share = route.weighed(grads, *self.weights(weight, route.devices))
        else:
            scale, share = self.weights(weight)
            if scale is not None:
                grads = [scale * g for g in grads]
        # S = w g at the window's start, else S + w g; W likewise with w
        # (none for a skipped micro-batch).
        kernels.window_sums(self._accumulators_of(variables), grads, start)
        share = kernels.masked(ok, share, 0.0)
        self._weight.assign(kernels.window_sum(self._weight, share, start))

    def _window_ok(self, boundary):
        if self._nonfinite_policy.empties_windows:
            return self._weight > 0.0  # every micro-batch skipped: nothing to apply
        return super()._window_ok(boundary)

    def _window_state(self):
        return self._accumulators + [self._weight]

    def _process_sums(self):
        return self._accumulators + [self._weight]

    def _window_sums(self):
        # A NaN or an Inf propagates into S: one check per window suffices.
        return self._accumulators

    def _update(self, variables, keep):
        sums = [ops.convert_to_tensor(a) for a in self._accumulators_of(variables)]
        weight = ops.convert_to_tensor(self._weight)
        route = self._device_route
        if route is not None:
            # The devices' sums, reduced once inside the window-end `lax.cond`.
            return self._step_inner(lambda: self.means(route.total(sums), weight), variables, keep)
        means = self.means(sums, weight)
        # The driver's: a branch, or (traced JAX) the values its `lax.cond` takes.
        return self._step_inner(means, variables, keep)

    def _wrapped_optimizers(self):
        return [self.inner_optimizer]

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": saving.serialize_keras_object(self.inner_optimizer),
            "steps": schedules.serialize_steps(self.steps),
            "nonfinite": self.nonfinite,
            "flush_last_window": self.flush_last_window,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Keras's optimizer table, not the saved class path (PyTorch saves its own
        # Adam subclass). A copy: `deserialize` lowercases the class name in place.
        inner = copy.deepcopy(config.pop("optimizer"))
        optimizer = optimizers.deserialize(inner, custom_objects=custom_objects)
        return cls(optimizer, **config)
