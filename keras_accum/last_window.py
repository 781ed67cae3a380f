"""Training that ends inside a window: `pending_micro_batches`, the warning
`fit` gives there, and the opt-in flush (`flush_last_window`, `flush()`).
Mixed into `base.AccumulationOptimizer`; see docs/guides/reliability.md.
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
        """Micro-batches (per replica) of the current window not applied yet
        (0 at a boundary and right after a `flush`). Eager only.

        Returns:
            int, the count.
        """
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
        # A flush in this window (this process's record, ignored after a restore to before it).
        flushed = self.__dict__.get("_flushed_at")
        if flushed is not None and start <= flushed <= step:
            start = flushed
        return step - start

    def flush(self) -> bool:
        """Applies the current window now, as its end would, and counts one
        update. Eager only: call it between steps, e.g. when your loop ends.

        Returns:
            bool, whether there was anything to apply.

        Raises:
            ValueError: the optimizer cannot apply a partial window.
            RuntimeError: called inside a traced step.
        """
        if self._refuses_flush:
            raise ValueError(f"{self._refuses_flush} Received: a call of flush()")
        if not _backend.executing_eagerly():
            raise RuntimeError(f"{type(self).__name__}.flush() runs eagerly, between steps.")
        if not self.pending_micro_batches():
            return False
        # The window's end, then its sums cleared: what follows finishes it by count.
        self._flush_window()
        self.__dict__["_flushed_at"] = _int(self._window.micro_step)
        return True

    def finalize_variable_values(self, var_list):
        # Keras's `fit` calls this once, when training ends.
        self._end_of_training()
        super().finalize_variable_values(var_list)

    def _end_of_training(self):
        """A flush with `flush_last_window` (not after an error), else the warning."""
        if self.flush_last_window and sys.exc_info()[0] is None:
            self.flush()
            return
        self._warn_pending_window()

    def _warn_pending_window(self):
        """Warns, once, when training ends inside a window."""
        if not _backend.executing_eagerly() or getattr(self, "_warned_pending", False):
            return
        try:
            pending = self.pending_micro_batches()
        except Exception:
            # Called in a `finally` after a failed step too: never replace the user's error.
            return
        if pending:
            # Once per optimizer: `fit(epochs=1)` in a loop carries the window over.
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
    """Checks `flush_last_window`: a bool, refused where a flush is."""
    if not isinstance(flush_last_window, bool):
        raise ValueError(
            f"`flush_last_window` must be True or False. "
            f"Received: flush_last_window={flush_last_window!r}"
        )
    if flush_last_window and optimizer._refuses_flush:
        raise ValueError(f"{optimizer._refuses_flush} Received: flush_last_window=True")
    return flush_last_window
