"""The `nonfinite` policies the drivers ask, and the one-line error of
"raise". What each policy does: docs/guides/reliability.md."""

import contextlib
import re

# How `nonfinite="raise"` words its error (see `explained`).
MESSAGE = "non-finite gradient (nonfinite=raise)"  # no quotes: errors escape them


class Policy:
    """One value of the `nonfinite` argument, as plain attributes the drivers
    read (never the policy's name).

    Attributes:
        name: the argument's value (`"skip_micro_batch"`, ..., or None).
        screens: each micro-batch is checked (every policy but None).
        raises: a non-finite micro-batch stops the step (`"raise"`).
        skips: a non-finite micro-batch reaches the rule as zeros, with
            `ok` False (the `skip_*` policies).
        drops_windows: a window holding a non-finite micro-batch (its bad
            count `window_bad` > 0, or non-finite sums) is not applied but
            counted in `skipped_updates`, and its sums cleared.
        empties_windows: a window whose micro-batches were all left out
            must not be applied (`"skip_micro_batch"`).
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

    For TensorFlow's "Graph execution error" of a compiled step; other errors
    pass through unchanged.

    Raises:
        NonFiniteGradientError: where the block raised `nonfinite="raise"`'s error.

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
        # TensorFlow's `InvalidArgumentError`, not named: under JAX and PyTorch
        # `tf` is a stand-in that no `except` clause may name.
        found = _RAISED.search(getattr(error, "message", None) or str(error))
        if found is None:
            raise
        raise NonFiniteGradientError(f"{found.group(1)} {found.group(2)}") from None
