"""What the optimizers do with a NaN or an Inf gradient: the `nonfinite`
argument's policy table, and the one-line error of "raise" (the check of
a micro-batch is each driver's: `all_finite` of the TensorFlow driver,
`kernels.finite` elsewhere).

+----------------------+----------------------------------------+-------------------------+
| policy               | a non-finite micro-batch               | counted in              |
+======================+========================================+=========================+
| `"skip_micro_batch"` | left out of its window (no weight)     | `skipped_micro_batches` |
+----------------------+----------------------------------------+-------------------------+
| `"skip_window"`      | its window's update is dropped         | `skipped_updates`       |
+----------------------+----------------------------------------+-------------------------+
| `"raise"`            | InvalidArgumentError (not under XLA)   | -                       |
+----------------------+----------------------------------------+-------------------------+
| `None`               | no check: it propagates, as in Keras   | -                       |
+----------------------+----------------------------------------+-------------------------+

Window state is reset at a window's start whatever its first micro-batch
does, so a skip never leaves the previous window's sums or update in place.
Where its window's end runs only at the end (PyTorch; TensorFlow in graph
mode) `GradientAccumulation` checks "skip_window" on its window sums once
(NaN and Inf propagate into a sum); elsewhere (JAX, XLA), and for the Adam
variants, each micro-batch is checked and a bad one marks the window. `InvariantAdam` folds each
micro-batch into its moments and cannot drop a window afterwards: it
refuses "skip_window".
"""

import contextlib
import re

# How `nonfinite="raise"` words its error (see `explained`).
MESSAGE = "non-finite gradient (nonfinite=raise)"  # no quotes: errors escape them

POLICIES = {
    "skip_micro_batch": "the micro-batch is left out of its window",
    "skip_window": "the window's update is dropped",
    "raise": "tf.errors.InvalidArgumentError at the first non-finite value",
    None: "no check",
}


class NonFiniteGradientError(ValueError):
    """A non-finite gradient under `nonfinite="raise"`, in one line."""


# "[NAME: MESSAGE at micro-step] [N]" in a compiled step, "NAME: MESSAGE at
# micro-step" then N on its own line eagerly.
_RAISED = re.compile(r"([^\s\[\]\"']+: " + re.escape(MESSAGE) + r" at micro-step)\W*(\d+)")


@contextlib.contextmanager
def explained():
    """Turns the error of `nonfinite="raise"` into a `NonFiniteGradientError`
    whose one line names the optimizer, the policy and the micro-step.

    TensorFlow reports an error of a compiled step as "Graph execution
    error:" followed by the trace of the op that failed; the optimizer's
    words are buried below it. Under PyTorch the eager step raises
    `NonFiniteGradientError` itself (JAX refuses `"raise"`: a compiled step
    cannot raise). Other errors pass through unchanged, on every backend.

    Example:
        ::

            with keras_accum.nonfinite.explained():
                model.fit(x, y)
    """
    try:
        yield
    except NonFiniteGradientError:
        raise  # PyTorch's eager step raises it in one line already
    except Exception as error:
        # TensorFlow: an `InvalidArgumentError` whose `message` holds the
        # optimizer's words. No TensorFlow name here: under JAX and PyTorch
        # `tf` is a stand-in that no `except` clause may name.
        found = _RAISED.search(getattr(error, "message", None) or str(error))
        if found is None:
            raise
        raise NonFiniteGradientError(f"{found.group(1)} {found.group(2)}") from None
