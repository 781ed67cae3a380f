"""Restoring an optimizer's state, or refusing to lose it: a mismatch
raises (Keras only warns), and a state loaded before `build` is restored then.
"""

import warnings

import keras
import numpy as np

from keras_accum import _backend


class StateMixin:
    """`AccumulationOptimizer`'s weights and checkpoint loading."""

    def get_weights(self):
        """Values of `variables`, a wrapped optimizer's too (per-device rows
        gathered: on several processes, every process must call it)."""
        route = getattr(self, "_device_route", None)
        if route is None:
            return [keras.ops.convert_to_numpy(v) for v in self.variables]
        return [route.whole(v) if route.holds(v) else v.numpy() for v in self.variables]

    def set_weights(self, weights):
        """Sets `variables` in `get_weights`' order."""
        if not self.built:
            raise ValueError("Build the optimizer before calling `set_weights()`.")
        if len(weights) != len(self.variables):
            raise ValueError(
                f"`weights` must hold {len(self.variables)} arrays. "
                f"Received: len(weights)={len(weights)}"
            )
        for variable, weight in zip(self.variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape "
                    f"{tuple(variable.shape)}. Received: weight shape "
                    f"{tuple(np.shape(weight))}"
                )
            variable.assign(weight)

    def save_own_variables(self, store):
        """Keras's; a per-device variable stores this process's rows."""
        for i, variable in enumerate(self.variables):
            store[str(i)] = self._state_value(variable)

    def _state_value(self, variable):
        route = getattr(self, "_device_route", None)
        if route is not None and route.holds(variable):
            return route.local_rows(variable)
        return variable.numpy()

    def _assign_state(self, variable, value):
        """`variable.assign(value)`, per-device rows placed back."""
        route = getattr(self, "_device_route", None)
        if route is not None and route.holds(variable):
            value = route.rows_from(variable, value)
        variable.assign(value)

    def load_own_variables(self, store):
        saved = len(store.keys())
        if saved == len(self.variables):
            for i, variable in enumerate(self.variables):
                self._assign_state(variable, store[str(i)])
        elif not self.built:
            # Compiled, not trained yet: restored at `build`.
            self._defer_state([np.array(store[str(i)]) for i in range(saved)])
        elif saved == getattr(self, "_unbuilt_count", None):
            warnings.warn(
                f"Optimizer '{self.name}' was saved before its first step: no "
                "state to restore, it starts afresh.",
                stacklevel=2,
            )
        else:
            raise self._mismatch(saved)

    def _defer_state(self, state):
        """Keeps a loaded state until `build` (`_restore_deferred_state`)."""
        self._deferred_state = state

    def _mismatch(self, saved):
        return ValueError(
            f"Cannot restore optimizer '{self.name}': it has {len(self.variables)} "
            f"variables, the saved state has {saved}. Was it saved with another "
            "`steps` or another optimizer? Rebuild it as saved, or leave the "
            "optimizer's state out (`load_model(..., compile=False)`, "
            "`load_weights(..., skip_mismatch=True)`)."
        )

    def _restore_deferred_state(self):
        """End of `build`: the state `load_own_variables` kept for later."""
        state = getattr(self, "_deferred_state", None)
        if state is None:
            return
        self._deferred_state = None
        if len(state) == self._unbuilt_count:
            return  # saved before its first step: nothing to restore
        if len(state) != len(self.variables):
            # Too late to raise where `skip_mismatch` could catch it: warn.
            warnings.warn(
                f"{self._mismatch(len(state))} Its saved state is skipped: it starts afresh.",
                stacklevel=2,
            )
            return
        with _backend.init_scope():  # once, eagerly, also when built while tracing
            for variable, value in zip(self.variables, state):
                self._assign_state(variable, value)
