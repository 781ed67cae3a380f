"""Constructor, clipping and Adam arithmetic of the two Adam variants."""

from typing import Any

import keras
from keras import ops

from keras_accum import _compat, _replicas, equations
from keras_accum.base import AccumulationOptimizer
from keras_accum.validation import check_choice, check_float, check_rate

# Base-optimizer arguments the Adam variants do not implement.
ADAM_UNSUPPORTED = ("gradient_accumulation_steps",)
# Variables of these dtypes keep their moments in `state_dtype`.
LOW_PRECISION = ("bfloat16", "float16")
STATE_DTYPES = ("float32", None)


class AdamFamily(AccumulationOptimizer):
    """Constructor and config shared by the two Adam variants.

    Keras's optimizer arguments are accepted, as in `keras.optimizers.Adam`
    at `steps=1`; see docs/guides/adam.md (Reference) for what each does.
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        steps: Any = 1,
        nonfinite: str | None = "skip_micro_batch",
        weight_decay: float | None = None,
        name: str | None = None,
        state_dtype: str | None = "float32",
        flush_last_window: bool = False,
        **kwargs: Any,
    ):
        for unsupported in ADAM_UNSUPPORTED:
            if kwargs.get(unsupported):
                raise ValueError(
                    f"{self.__class__.__name__} does not support `{unsupported}`"
                    f" (set `steps`). Received: {unsupported}={kwargs[unsupported]!r}"
                )
        check_rate("learning_rate", learning_rate)
        if weight_decay is not None:
            check_rate("weight_decay", weight_decay)
        for beta_name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not callable(beta):
                check_float(beta_name, beta, minimum=0.0, maximum=1.0, open_maximum=True)
        check_float("epsilon", epsilon, minimum=0.0)
        super().__init__(
            learning_rate=learning_rate,
            steps=steps,
            nonfinite=nonfinite,
            weight_decay=weight_decay,
            name=name,
            flush_last_window=flush_last_window,
            **kwargs,
        )
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.state_dtype = check_choice("state_dtype", state_dtype, STATE_DTYPES)

    def _slot_dtype(self, dtype):
        """`state_dtype` for a bfloat16 or float16 `dtype`, else `dtype`."""
        dtype = keras.backend.standardize_dtype(dtype)
        return self.state_dtype if self.state_dtype and dtype in LOW_PRECISION else dtype

    def _slot(self, variable, name):
        """A slot named and sharded after `variable`, in `_slot_dtype`."""
        dtype = self._slot_dtype(variable.dtype)
        if dtype == keras.backend.standardize_dtype(variable.dtype):
            return self.add_variable_from_reference(variable, name)
        layout = _compat.variable_layout(variable)
        return self.add_variable(
            shape=variable.shape,
            dtype=dtype,
            name=_replicas.slot_name(variable, name),
            **({} if layout is None else {"layout": layout}),
        )

    def _clips(self):
        """True when `clipnorm`, `global_clipnorm` or `clipvalue` is set."""
        return bool(self.clipnorm or self.global_clipnorm or self.clipvalue)

    def _clip_micro_batch(self, grads, replicas):
        """Keras's clipping of one micro-batch's mean gradient (its share
        arrives `replicas` times smaller)."""
        if not self._clips():
            return grads
        if replicas == 1:
            return _compat.clip_gradients(self, grads)
        clipped = _compat.clip_gradients(self, [g * replicas for g in grads])
        return [g / replicas for g in clipped]

    def _adam_alpha(self, learning_rate, count, dtype):
        """Keras Adam's alpha = lr sqrt(1 - beta_2^count) / (1 - beta_1^count)."""
        return equations.adam_alpha(learning_rate, count, self.beta_1, self.beta_2, dtype)

    def _decay_of(self, variable, learning_rate):
        """(weight_decay, lr) in the step's dtype where the update decays
        `variable` (`equations.decayed`), else None."""
        if self.weight_decay is None or not _compat.uses_weight_decay(self, variable):
            return None
        dtype = self._slot_dtype(variable.dtype)  # the step's (float32 state of bfloat16)
        return ops.cast(self.weight_decay, dtype), ops.cast(learning_rate, dtype)

    def _decay(self, variable, lr):
        decay = self._decay_of(variable, lr)
        if decay is not None:
            variable.assign(equations.decayed(variable, *decay))

    def get_config(self):
        config = super().get_config()
        for name in ADAM_UNSUPPORTED:
            config.pop(name, None)
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon})
        config["state_dtype"] = self.state_dtype
        return config
