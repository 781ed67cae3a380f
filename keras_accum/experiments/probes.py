"""Probes that look inside a traced or compiled step, for the benchmark and
the tests: the cross-replica reductions an optimizer makes while it is
traced (`count_reductions`) and the elements XLA's `copy` instructions move
in an optimised HLO module (`count_copies`). Nothing here runs in training.
"""

import contextlib
import re

import numpy as np

from keras_accum._backend import tf

# A `tf.cond` branch is traced as a FuncGraph named "<scope>_true_<uid>" or
# "<scope>_false_<uid>" (while loops give "while_body_<uid>" instead).
_BRANCH = re.compile(r"_(true|false)_\d+$")


def _in_conditional():
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if _BRANCH.search(getattr(graph, "name", "") or ""):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _elements(strategy, value):
    """Elements of one replica's part of a (possibly nested) value."""
    total = 0
    for leaf in tf.nest.flatten(value):
        local = strategy.experimental_local_results(leaf)[0]
        total += int(np.prod(local.shape)) if local.shape.rank else 1
    return total


@contextlib.contextmanager
def count_reductions(strategy, optimizer, counts):
    """Counts, while tracing, the cross-replica reductions that `optimizer`
    makes (`reduce_to`, `batch_reduce_to`: all-reduces, sync-on-read reads;
    the loss and metrics' own reductions are left out) and the elements they
    carry, split into "every_step" (outside any conditional) and
    "conditional" (inside a `tf.cond` branch: the window's end)."""
    extended = strategy.extended
    originals = extended.reduce_to, extended.batch_reduce_to, optimizer.apply_gradients
    inside = []

    def record(values):
        if not inside:
            return
        where = "conditional" if _in_conditional() else "every_step"
        counts[where + "_calls"] = counts.get(where + "_calls", 0) + 1
        size = sum(_elements(strategy, v) for v in values)
        counts[where + "_elements"] = counts.get(where + "_elements", 0) + size

    def reduce_to(reduce_op, value, destinations, options=None):
        record([value])
        return originals[0](reduce_op, value, destinations, options)

    def batch_reduce_to(reduce_op, value_destination_pairs, options=None):
        pairs = list(value_destination_pairs)
        record([v for v, _ in pairs])
        return originals[1](reduce_op, pairs, options)

    def apply_gradients(*args, **kwargs):
        inside.append(True)
        try:
            return originals[2](*args, **kwargs)
        finally:
            inside.pop()

    extended.reduce_to, extended.batch_reduce_to = reduce_to, batch_reduce_to
    optimizer.apply_gradients = apply_gradients
    try:
        yield counts
    finally:
        del extended.reduce_to, extended.batch_reduce_to, optimizer.apply_gradients


# A copy instruction's output shape, e.g. "%copy.3 = f32[1024,2048]{1,0} copy(".
_COPY = re.compile(r"= f32\[([\d,]*)\]\S* copy\(")


def count_copies(hlo_lines):
    """Elements moved by `copy` instructions in an optimised HLO module,
    split by where they run: "entry" (the entry computation: every step),
    "branches" (in a computation named after a `tf.cond` branch: when the
    branch is taken) and "other" (fusions, loop bodies, ...).

    Optimizer state is copied in "entry" (a variable read by one pass while
    another overwrites it in place, or a conditional's result moved into the
    variable's buffer) and in "branches" (a variable that a `tf.cond` branch
    writes, carried through the other branch). "other" holds layout copies
    inside fusions, of activations (the transformer's attention heads,
    [batch, tokens, heads, width]), not of state.
    """
    counts = {"entry": 0, "branches": 0, "other": 0}
    where = None
    for line in hlo_lines:
        if line.endswith("{\n") and not line.startswith(" "):
            name = line.split(" ", 1)[0]
            if line.startswith("ENTRY"):
                where = "entry"
            elif "_cond" in name or "cond_" in name:
                where = "branches"  # tf.cond branches keep their names.
            else:
                where = "other"
        match = _COPY.search(line)
        if match and where:
            dims = [int(d) for d in match.group(1).split(",") if d]
            counts[where] += int(np.prod(dims)) if dims else 1
    return counts
