"""The window's end under XLA: every micro-step computes the update, and a
select keeps it only at the window's boundary.

Under XLA a `tf.cond` whose branch assigns to a variable carries that
variable through the conditional, and XLA copies it (a full read and write)
on every micro-step that does not take the branch: N - 1 of every N. A
select, `where(keep, new, old)`, fuses into the pass that computes `new` and
writes the variable in place instead. The price is the update's arithmetic
on every micro-step: one fused elementwise pass over what it reads and
writes, where the cond copied each carried variable.

`keep_where` snapshots the state an update may write, runs the update and
selects. The optimizers' own `assign`, `assign_add` and `assign_sub` (what a
Keras `update_step` writes slots and variables with) are routed meanwhile to
write the kept value directly, so that the rest of the update reads the kept
slot, as plain Adam reads its new moments. Selecting only after the whole
update would leave two readers of each old slot (its own select, and
theta's pass, which recomputes the new slot from the old one), and XLA
copies a buffer that one pass reads while another overwrites it in place.
"""

import contextlib

import keras
import tensorflow as tf


def _key(variable):
    """The `tf.Variable` behind a Keras variable (both are passed around)."""
    return id(variable.value if isinstance(variable, keras.Variable) else variable)


class KeptWrites:
    """Writes to `variables` that hold only where `keep` (a boolean scalar
    tensor) is True; elsewhere each variable keeps its value from before.

    Use: `kept = KeptWrites(keep, variables)`, run the update (direct
    assigns, and `kept.assign` or `kept.routing(optimizer)` for what it
    reads back), then `kept.restore()`.
    """

    def __init__(self, keep, variables):
        self.keep = keep
        self._variables = list(variables)
        self._before = {_key(v): tf.identity(tf.convert_to_tensor(v)) for v in self._variables}
        self._selected = set()

    def assign(self, assign, variable, value, mode="assign"):
        """variable = where(keep, new, old), where new is `value` (mode
        "assign"), old + value ("assign_add") or old - value ("assign_sub")
        and old its value before the update; written with `assign(variable,
        tensor)`. The variable then needs no select in `restore`, unless it
        is written otherwise too (`reselect`)."""
        current = tf.convert_to_tensor(variable)
        value = tf.cast(tf.convert_to_tensor(value), current.dtype)
        new = {"assign": value, "assign_add": current + value, "assign_sub": current - value}[mode]
        old = self._before.get(_key(variable), current)
        assign(variable, tf.where(self.keep, new, old))
        self._selected.add(_key(variable))

    def restore(self, reselect=()):
        """Puts back the old value where `keep` is False in every variable
        not written by `assign` (and in those of `reselect`, which may have
        been written otherwise after it). An untouched variable becomes
        where(keep, x, x) = x, which XLA drops."""
        again = {_key(v) for v in reselect}
        for variable in self._variables:
            key = _key(variable)
            if key in self._selected and key not in again:
                continue
            variable.assign(tf.where(self.keep, tf.convert_to_tensor(variable), self._before[key]))

    @contextlib.contextmanager
    def routing(self, optimizer):
        """Routes `optimizer.assign`, `assign_add` and `assign_sub` (what a
        Keras optimizer's `update_step` writes its slots and variables with)
        through `assign`, so that the update reads back the kept values."""
        names = ("assign", "assign_add", "assign_sub")
        # The kept value is whole: written with the class's own `assign`.
        write = lambda variable, value: type(optimizer).assign(optimizer, variable, value)
        for name in names:

            def assign(variable, value, mode=name):
                self.assign(write, variable, value, mode)

            setattr(optimizer, name, assign)
        try:
            yield
        finally:
            for name in names:
                delattr(optimizer, name)


def keep_where(keep, trainable_variables, state, optimizers, write):
    """Runs `write()` and keeps its writes only where `keep` holds.

    `state`: every variable the update may write, `trainable_variables`
    included; it writes them directly or through the `assign*` methods of
    `optimizers`.
    """
    kept = KeptWrites(keep, state)
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(kept.routing(optimizer))
        write()
    # Written again after the update's `assign*`: by a constraint, or by an
    # EMA overwrite (all of them); the kept select must cover those again.
    again = [v for v in trainable_variables if v.constraint is not None]
    if any(o.use_ema and o.ema_overwrite_frequency for o in optimizers):
        again = trainable_variables
    kept.restore(reselect=again)
