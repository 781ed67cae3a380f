"""Where training ends inside a window: the micro-batches folded in and not
applied yet (`pending_micro_batches`), the warning that says so when `fit`
ends there, and the opt-in flush that applies them (`flush_last_window`,
`flush()`), as a window of its own.

`fit` calls `finalize_variable_values` once, when training ends (under
JAX also when it ends in an error: then nothing is flushed, and the
user's error is never replaced). A flush applies what the window holds
now, as its end would (the mean of its micro-batches, weights and item
counts respected, for `GradientAccumulation`; the summed steps of
`UpdateAccumulationAdam`), counts an update, and clears the window's sums:
micro-batches that follow finish the same window by count and are applied
at its end alone. `InvariantAdam` folds each micro-batch with its window's
size and cannot apply part of a window as a window of its own: it refuses.
"""

import os
import sys
import warnings

from keras_accum import _backend

# Frames of these packages are not where a user's call is.
_LIBRARIES = tuple(
    os.path.dirname(sys.modules[name].__file__) + os.sep
    for name in ("keras", "tensorflow", "jax", "torch", __package__)
    if getattr(sys.modules.get(name), "__file__", None)
)


def caller_stacklevel():
    """The `stacklevel` that points a warning at the first frame outside
    keras_accum, Keras and TensorFlow (the user's `fit` call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def _int(variable):
    """A scalar variable's value as an int, eagerly."""
    return _backend.scalar_int(variable.value)


class LastWindowMixin:
    """`pending_micro_batches`, the end-of-training warning and `flush`."""

    # Set by an optimizer that cannot apply part of a window (the reason).
    _refuses_flush = None

    def pending_micro_batches(self) -> int:
        """Micro-batches (per replica) folded into the current window and
        not applied yet: 0 at a window's boundary, and right after a
        `flush`. Eager only."""
        if not self.built:
            return 0
        step = _int(self._window.micro_step)
        if isinstance(self.steps, int):
            start = step - step % self.steps
        else:
            end, size = _int(self._window.end), _int(self._window.size)
            if step >= end:
                return 0
            start = end - size
        # A flush inside this window (this process's record of it; one
        # from before a restore to an earlier micro-step does not count).
        flushed = self.__dict__.get("_flushed_at")
        if flushed is not None and start <= flushed <= step:
            start = flushed
        return step - start

    def flush(self) -> bool:
        """Applies the current window now, with what it holds, as its end
        would (see the module docstring); returns whether there was
        anything to apply (False at a window's boundary). Eager only: call
        it between training steps, e.g. when a loop of your own ends.
        Counts one update (`iterations`); a window the non-finite policy
        drops is dropped and counted as at its end."""
        if self._refuses_flush:
            raise ValueError(f"{self._refuses_flush} Received: a call of flush()")
        if not _backend.executing_eagerly():
            raise RuntimeError(f"{type(self).__name__}.flush() runs eagerly, between steps.")
        if not self.pending_micro_batches():
            return False
        # The driver's: the window's end, as `apply` ends one, then the
        # window's sums cleared: the micro-batches that follow finish the
        # window (by count) as one of their own.
        self._flush_window()
        self.__dict__["_flushed_at"] = _int(self._window.micro_step)
        return True

    def finalize_variable_values(self, var_list):
        # Keras's `fit` calls this once, when training ends.
        self._end_of_training()
        super().finalize_variable_values(var_list)

    def _end_of_training(self):
        """With `flush_last_window`, a flush (not when `fit` ends in an
        error, which JAX finalizes in a `finally`); else the warning."""
        if self.flush_last_window and sys.exc_info()[0] is None:
            self.flush()
            return
        self._warn_pending_window()

    def _warn_pending_window(self):
        """Says so when training ends inside a window, whose micro-batches
        are accumulated but not applied."""
        if not _backend.executing_eagerly() or getattr(self, "_warned_pending", False):
            return
        try:
            pending = self.pending_micro_batches()
        except Exception:
            # Keras calls this in a `finally` also when a step failed (under
            # JAX the state may then be unreadable): a warning must never
            # replace the user's own error.
            return
        if pending:
            # Once per optimizer: `fit(epochs=1)` in a loop is a pattern the
            # README shows, and a partial window carries over to the next.
            self._warned_pending = True
            size = self.steps if isinstance(self.steps, int) else _int(self._window.size)
            warnings.warn(
                f"{type(self).__name__} '{self.name}': training ended inside a window: "
                f"{pending} of its {size} micro-batches (per replica) are accumulated "
                "but not applied. They are applied if training goes on with this "
                "optimizer (its state is saved with it); to end on an update, make "
                "the micro-batches trained a multiple of `steps`, or pass "
                "`flush_last_window=True`.",
                stacklevel=caller_stacklevel(),
            )


def check_flush(optimizer, flush_last_window):
    """`flush_last_window` checked: a bool, and refused by an optimizer that
    cannot apply part of a window."""
    if not isinstance(flush_last_window, bool):
        raise ValueError(
            f"`flush_last_window` must be True or False. "
            f"Received: flush_last_window={flush_last_window!r}"
        )
    if flush_last_window and optimizer._refuses_flush:
        raise ValueError(f"{optimizer._refuses_flush} Received: flush_last_window=True")
    return flush_last_window
