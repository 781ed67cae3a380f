"""What the optimizers do with a NaN or an Inf gradient: the `nonfinite`
argument's policies (`Policy` objects, which the drivers ask what to do),
and the one-line error of "raise" (the check of a micro-batch is each
driver's: `all_finite` of the TensorFlow driver, `kernels.finite`
elsewhere).

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


class Policy:
    """One value of the `nonfinite` argument, as the drivers ask it: whether
    a micro-batch is screened, what a bad one does, whether the window may
    be applied, and what a dropped window leaves (the drivers ask these
    answers, never the policy's name). Plain attributes: reading them
    enters no function of this module on a traced step.

    Attributes:
        name: the argument's value (`"skip_micro_batch"`, ..., or None).
        screens: each micro-batch is checked (every policy but None).
        raises: a non-finite micro-batch stops the step (`"raise"`).
        skips: a non-finite micro-batch reaches the rule as zeros, with
            `ok` False (the `skip_*` policies).
        drops_windows: a window that holds a non-finite micro-batch is not
            applied, and counted in `skipped_updates` (`"skip_window"`):
            the window may be applied only where its count of bad
            micro-batches (`window_bad`) is 0, or where its sums, which a
            NaN propagates into (`_checks_window_sums`), are finite; a
            dropped window's sums are cleared, so that no NaN outlives it.
            A skipped micro-batch is then counted in
            `skipped_micro_batches` only where the sums would not show it.
        empties_windows: a window may reach its end with every micro-batch
            left out, and must then not be applied (`"skip_micro_batch"`:
            under "skip_window" such a window is dropped anyway).
    """

    def __init__(
        self, name: str | None, *, raises: bool = False, skips: bool = False, drops: bool = False
    ):
        self.name = name
        self.screens = name is not None
        self.raises, self.skips, self.drops_windows = raises, skips, drops
        self.empties_windows = skips and not drops

    def __repr__(self) -> str:
        return f"nonfinite.Policy({self.name!r})"


# The policies, by the argument's value (the order the errors list them).
POLICIES = {
    policy.name: policy
    for policy in (
        Policy("skip_micro_batch", skips=True),
        Policy("skip_window", skips=True, drops=True),
        Policy("raise", raises=True),
        Policy(None),
    )
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
