"""Shared machinery of the keras_accum optimizers.

Every keras_accum optimizer sees one *micro-batch* gradient per `apply` call
and changes the model's variables once per *window* of `steps` calls. Under a
`tf.distribute` strategy each call carries one micro-batch per replica, so a
window holds `kappa = steps * num_replicas_in_sync` micro-batches.

How a call is processed (TensorFlow backend):

1. `apply` runs in replica context, as Keras's `train_step` and a custom
   `strategy.run` loop call it. It immediately enters cross-replica context
   with `merge_call`, so that the window boundary is decided there. A `cond`
   whose branch needs a sync point cannot live in replica context (the crash
   of Keras's own `gradient_accumulation_steps` under MirroredStrategy,
   keras-team/keras#20582); Keras's `LossScaleOptimizer` does the same.
2. `_accumulate` (subclass) folds the micro-batch into the optimizer state,
   replica-locally where the algorithm allows it (no communication).
3. The micro-step counter advances; at a boundary `_update` (subclass)
   changes the model variables and `iterations` (the update count, which
   learning-rate schedules see) advances by one.

Incoming gradients follow the Keras convention: each replica's gradient is
its share of the global mean, i.e. the gradient of the replica's summed loss
divided by the *global* number of items (what `model.fit` produces); summed
over replicas it is the gradient of the global micro-batch mean.

Non-finite gradients are governed by `nonfinite`:

* `"skip_micro_batch"` (default): a micro-batch with a NaN or Inf gradient on
  a replica is left out of the window; `skipped_micro_batches` counts it.
* `"skip_window"`: the update of the window containing it is dropped: the
  parameters do not move (moments already updated by earlier micro-batches
  keep them, see `UpdateAccumulationAdam`; `InvariantAdam` refuses it).
* `"raise"`: `tf.errors.InvalidArgumentError` at the first non-finite value.
* `None`: no check (fastest; a NaN then propagates as in plain Keras).

State, field by field (creation order is the checkpoint format):
`iterations` (updates applied), `micro_step` (calls to `apply`),
`skipped_micro_batches` (per replica, summed on read), `skipped_updates`
(windows whose update was dropped), `window_bad` (non-finite micro-batches
in the current window, for `"skip_window"`), then each subclass's slots.
"""

import contextlib

import keras
import tensorflow as tf
from keras import initializers, optimizers

from keras_accum import schedules
from keras_accum.validation import check_choice

NONFINITE_POLICIES = ("skip_micro_batch", "skip_window", "raise", None)


def all_finite(grads):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def dense(grad):
    """Gradients as dense tensors (an Embedding gives `tf.IndexedSlices`)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def read_total(variable):
    """Value of a replica-local (sync-on-read) variable summed over replicas.

    Called in cross-replica context, where reading such a variable performs
    the reduction: this is the single communication of a window.
    """
    return tf.convert_to_tensor(variable.value)


def assign_total(variable, value):
    """Cross-replica assign to a replica-local variable: each replica gets
    value / replicas. No read-back (that would be one more reduction)."""
    variable.value.assign(tf.cast(value, variable.dtype), read_value=False)


class AccumulationOptimizer(schedules.WindowMixin, optimizers.Optimizer):
    """Base class: one micro-batch per `apply`, one update per window."""

    def __init__(self, learning_rate, steps=1, nonfinite="skip_micro_batch", **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.steps = schedules.check_steps(steps)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)

    def build(self, var_list):
        super().build(var_list)
        self._micro_step = self.add_variable(
            (),
            dtype="int64",
            aggregation="only_first_replica",
            name="micro_step",
        )
        self._skipped_micro_batches = self.add_local_variable(
            (), dtype="int64", name="skipped_micro_batches"
        )
        self._skipped_updates = self.add_variable(
            (),
            dtype="int64",
            aggregation="only_first_replica",
            name="skipped_updates",
        )
        self._window_bad = self.add_local_variable((), dtype="int64", name="window_bad")
        self._build_window()

    def add_local_variable(self, shape, dtype, name, reference=None):
        """A replica-local variable: each replica holds its own part and a
        read in cross-replica context (or a checkpoint) sees the sum; a
        cross-replica assign splits the value evenly over the replicas."""
        colocate = contextlib.nullcontext()
        if reference is not None:
            prefix = getattr(reference, "path", reference.name)
            name = f"{prefix.replace('/', '_').replace(':', '_')}_{name}"
            colocate = self._distribution_strategy.extended.colocate_vars_with(
                getattr(reference, "value", reference)
            )
        with colocate, keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer=initializers.get("zeros"),
                shape=shape,
                dtype=dtype,
                trainable=False,
                aggregation="sum",
                synchronization="on_read",
                name=name,
            )
        self._track_variable(variable)
        return variable

    # -- counters -----------------------------------------------------------

    @property
    def micro_step(self):
        """Number of `apply` calls so far (micro-batches per replica)."""
        return self._micro_step

    @property
    def skipped_micro_batches(self):
        return self._skipped_micro_batches

    @property
    def skipped_updates(self):
        return self._skipped_updates

    def has_updated(self):
        """True when the last `apply` call ended a window (an update was
        applied, or dropped under a `skip_*` policy and counted)."""
        step = self._micro_step
        return tf.logical_and(step > 0, self._window_done(step))

    # -- the step -----------------------------------------------------------

    def apply_gradients(self, grads_and_vars, weight=None):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight)
        return self.iterations

    def apply(self, grads, trainable_variables=None, weight=None):
        """Folds one micro-batch in; updates the variables at a boundary.

        Args:
            grads: gradients, one per trainable variable (Keras convention
                under a strategy, see the module docstring).
            trainable_variables: the variables; required on the first call.
            weight: optional number of items (or tokens) in the global
                micro-batch these gradients average over. Only
                `GradientAccumulation` uses it: the window mean is then
                weighted by item counts, exact for unequal micro-batches.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`trainable_variables` must be given on the first call "
                    "to `apply`, or the optimizer built beforehand."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        grads = [g for g, _ in pairs]
        trainable_variables = [v for _, v in pairs]
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise ValueError(
                f"{self.__class__.__name__}.apply() must be called in a "
                "replica context (inside `strategy.run`), not in "
                "cross-replica context."
            )
        weight = 1.0 if weight is None else weight
        with keras.name_scope(self.name, caller=self):
            replica_context.merge_call(self._merge_apply, args=(grads, trainable_variables, weight))

    def _merge_apply(self, distribution, grads, trainable_variables, weight):
        # Cross-replica context from here on: `grads` are per-replica values.
        window_start = self._start_window()
        self._accumulate(distribution, grads, trainable_variables, weight, window_start)
        micro_step = self._micro_step.assign_add(1)
        if self.steps == 1:
            self._end_window(distribution, trainable_variables)
        else:
            tf.cond(
                self._window_done(micro_step),
                lambda: self._end_window(distribution, trainable_variables),
                lambda: None,
            )

    def _end_window(self, distribution, trainable_variables):
        window = self._read_window(distribution)

        def update():
            self._update(distribution, trainable_variables, window)
            self._iterations.assign_add(1)

        def drop():
            self._skipped_updates.assign_add(1)

        window_ok = self._window_ok(window)
        if self.nonfinite == "skip_window":
            clean = tf.equal(read_total(self._window_bad), 0)
            window_ok = clean if window_ok is None else window_ok & clean
        if window_ok is None:
            update()
        else:
            tf.cond(window_ok, update, drop)
        if self.nonfinite == "skip_window":
            assign_total(self._window_bad, 0)
        self._after_window(distribution)

    def _guarded(self, grads, fold, skip):
        """Runs `fold(grads)` on one replica under the non-finite policy;
        `skip()` marks a dropped micro-batch. Replica context, no sync."""
        if self.nonfinite is None:
            fold(grads)
        elif self.nonfinite == "raise":
            fold(
                [
                    tf.debugging.check_numerics(
                        g, f"{self.name}: non-finite gradient (nonfinite='raise')"
                    )
                    for g in grads
                ]
            )
        else:

            def on_skip():
                self._skipped_micro_batches.assign_add(1)
                if self.nonfinite == "skip_window":
                    self._window_bad.assign_add(1)
                skip()

            tf.cond(all_finite(grads), lambda: fold(grads), on_skip)

    # -- subclass hooks -------------------------------------------------------

    def _accumulate(self, distribution, grads, variables, weight, start):
        raise NotImplementedError

    def _read_window(self, distribution):
        """Window-level totals read once at the boundary (cross-replica),
        handed to `_window_ok` and `_update`; None by default."""
        return None

    def _update(self, distribution, variables, window):
        raise NotImplementedError

    def _window_ok(self, window):
        """A boolean tensor saying whether the window may be applied, or
        None when it always is."""
        return None

    def _after_window(self, distribution):
        pass

    def load_own_variables(self, store):
        # Keras skips loading, with a mere warning, when the saved optimizer
        # has another number of variables (e.g. a changed `steps`): the run
        # would silently restart its moments and lose the window in progress.
        if len(store.keys()) != len(self.variables):
            raise ValueError(
                f"Cannot restore optimizer '{self.name}': it has "
                f"{len(self.variables)} variables, the saved state has "
                f"{len(store.keys())}. Was it saved with another `steps` or "
                "another optimizer? Rebuild it as saved, or load the model "
                "without its optimizer (`compile=False`)."
            )
        super().load_own_variables(store)

    def _check_unsupported(self, kwargs, names):
        """Refuses base-optimizer arguments this algorithm does not honour."""
        for name in names:
            if kwargs.get(name) not in (None, False):
                raise ValueError(
                    f"{self.__class__.__name__} does not support `{name}`. "
                    f"Received: {name}={kwargs[name]!r}"
                )

    def get_config(self):
        config = super().get_config()
        config.update({"steps": schedules.serialize_steps(self.steps), "nonfinite": self.nonfinite})
        return config


# Base-optimizer arguments the Adam variants do not implement.
ADAM_UNSUPPORTED = (
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "gradient_accumulation_steps",
    "loss_scale_factor",
)


class AdamFamily(AccumulationOptimizer):
    """Constructor and config shared by the two Adam variants."""

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        steps=1,
        nonfinite="skip_micro_batch",
        weight_decay=None,
        name=None,
        **kwargs,
    ):
        self._check_unsupported(kwargs, ADAM_UNSUPPORTED)
        super().__init__(
            learning_rate=learning_rate,
            steps=steps,
            nonfinite=nonfinite,
            weight_decay=weight_decay,
            name=name,
            **{k: v for k, v in kwargs.items() if k not in ADAM_UNSUPPORTED},
        )
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon

    def _adam_alpha(self, learning_rate, count, dtype):
        """alpha = lr * sqrt(1 - beta_2^count) / (1 - beta_1^count), as
        `keras.optimizers.Adam` computes it."""
        lr = tf.cast(learning_rate, dtype)
        count = tf.cast(count, dtype)
        return (
            lr
            * tf.sqrt(1 - tf.pow(tf.cast(self.beta_2, dtype), count))
            / (1 - tf.pow(tf.cast(self.beta_1, dtype), count))
        )

    def _decay(self, variable, lr):
        if self.weight_decay is not None and self._use_weight_decay(variable):
            # theta = theta - lr * weight_decay * theta
            variable.assign_sub(variable * tf.cast(self.weight_decay, variable.dtype) * lr)

    def get_config(self):
        config = super().get_config()
        for name in ADAM_UNSUPPORTED:
            config.pop(name, None)
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon})
        return config
