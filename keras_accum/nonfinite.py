"""What the optimizers do with a NaN or an Inf gradient: the `nonfinite`
argument, one policy table and one check.

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
`GradientAccumulation` checks "skip_window" on its window sums once, at the
window's end (NaN and Inf propagate into a sum); the Adam variants count bad
micro-batches in `window_bad` instead. `InvariantAdam` folds each
micro-batch into its moments and cannot drop a window afterwards: it
refuses "skip_window".
"""

import contextlib
import re

from keras_accum import _tensors
from keras_accum._backend import tf
from keras_accum._execution import in_xla

# How `nonfinite="raise"` words its error (see `explained`).
MESSAGE = "non-finite gradient (nonfinite=raise)"  # no quotes: errors escape them

POLICIES = {
    "skip_micro_batch": "the micro-batch is left out of its window",
    "skip_window": "the window's update is dropped",
    "raise": "tf.errors.InvalidArgumentError at the first non-finite value",
    None: "no check",
}

# Gradients under this many elements are checked elementwise under XLA
# (see `all_finite`).
SMALL = 65536


def all_finite(grads):
    """True when no gradient holds a NaN or an Inf (exact).

    NaN and Inf propagate into a sum: one `reduce_sum` read per gradient,
    no boolean tensor; the elementwise test runs in a `cond` only if a
    float32 sum overflows. Under XLA that `cond` carries its operands and
    costs the most with many small ones, where the elementwise test fused
    into one pass is cheap: gradients under `SMALL` elements are tested
    elementwise there, the rest by their sums (BENCHMARKS.md, "Non-finite
    check")."""
    grads = [_tensors.values_of(g) for g in grads]
    if not grads:
        return tf.constant(True)
    small, large = [], list(grads)
    if in_xla():
        small = [g for g in grads if _elements(g) < SMALL]
        large = [g for g in grads if _elements(g) >= SMALL]
    checks = [_elementwise_finite(small)] if small else []
    if large:
        sums = tf.stack([tf.reduce_sum(tf.cast(g, "float32")) for g in large])
        checks.append(
            tf.cond(
                tf.reduce_all(tf.math.is_finite(sums)),
                lambda: tf.constant(True),
                lambda: _elementwise_finite(large),
            )
        )
    return checks[0] if len(checks) == 1 else checks[0] & checks[1]


def _elementwise_finite(tensors):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


def _elements(tensor):
    count = tf.TensorShape(tensor.shape).num_elements()
    return SMALL if count is None else count


def refuse_raise_under_xla(name):
    """ValueError: XLA drops `check_numerics`, so "raise" cannot raise."""
    raise ValueError(
        f"{name}: `nonfinite='raise'` cannot raise in XLA-compiled code, where "
        "TensorFlow drops the check; use 'skip_micro_batch', 'skip_window' or "
        "None, or compile without XLA. Received: nonfinite='raise' with "
        "jit_compile=True"
    )


def screen(optimizer, grads, mask=True):
    """Applies `optimizer.nonfinite` to one replica's gradients (replica
    context, no communication).

    Returns `(grads, ok)`: under a `skip_*` policy `ok` is a boolean scalar
    (the skip counted on `optimizer`) and, with `mask`, a non-finite
    micro-batch comes back as zeros (an arithmetic mask, no branch over
    parameter-sized state); else `ok` is None.
    """
    policy = optimizer.nonfinite
    if policy is None:
        return grads, None
    if policy == "raise":
        if in_xla():
            refuse_raise_under_xla(optimizer.name)
        # One check of the micro-batch, naming the optimizer and the
        # micro-step; what follows waits for it (nothing folds a NaN in).
        message = f"{optimizer.name}: {MESSAGE} at micro-step"
        check = tf.debugging.Assert(
            all_finite(grads), [message, optimizer._micro_step + 1], summarize=1
        )
        with tf.control_dependencies([check]):
            return [_tensors.map_values(tf.identity, g) for g in grads], None
    ok = all_finite(grads)
    bad = 1 - tf.cast(ok, "int64")
    optimizer._skipped_micro_batches.assign_add(bad)
    if policy == "skip_window":
        optimizer._window_bad.assign_add(bad)
    if not mask:
        return grads, ok
    # g, or a broadcast scalar zero for a skipped micro-batch.
    keep = lambda x: tf.where(ok, x, tf.zeros((), x.dtype))
    return [_tensors.map_values(keep, g) for g in grads], ok


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
