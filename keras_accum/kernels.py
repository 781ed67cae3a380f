"""The optimizers' writes of one micro-batch, list-wise, and the flags
that guard them, in the form each backend runs fastest, picked once at
import: what the rules (each optimizer's `_fold`, `_update`) write with on
JAX and PyTorch.

Each optimizer's rule says *what* it writes, with the arithmetic of
`keras_accum.equations`; these functions say *how*:

* `keras.ops`, one variable at a time (JAX traces it into straight-line
  code, masks included). A flag (`start`, `keep`) may be a boolean tensor.
* Under PyTorch, which runs each call eagerly, Keras's own in-place
  `torch._foreach_*` forms (as `keras/src/backend/torch/optimizers/
  torch_adam.py`): one kernel per term for every variable, no copy. The
  flags are Python bools there (`decided`), and a skipped micro-batch
  writes nothing.

None of them asks which backend it is on: `IN_PLACE` (and `EAGER`) is
decided here, once.
"""

import numbers

from keras import ops

from keras_accum import _backend, _compat, equations

IN_PLACE = _backend.BACKEND == "torch"

# PyTorch runs each call eagerly: there a window's start, its end and a
# micro-batch's screen are read as Python bools, and what a window's end
# computes runs only at the end (a Python `if`, as Keras's own accumulation
# does on PyTorch). JAX traces the step: there they stay boolean tensors and
# every write is `where(keep, new, old)`.
EAGER = IN_PLACE


def decided(condition):
    """`condition` as a Python bool where the step runs eagerly (PyTorch);
    unchanged (a boolean tensor, or already a bool) under JAX."""
    if EAGER and not isinstance(condition, bool):
        return bool(condition)
    return condition


def masked(keep, new, old):
    """`new` where `keep` holds, else `old`; `new` (`old`) when `keep` is
    True (False)."""
    if keep is True:
        return new
    if keep is False:
        return old
    return ops.where(keep, ops.convert_to_tensor(new), ops.convert_to_tensor(old))


def both(a, b):
    """Logical and of two flags (Python bools or boolean tensors)."""
    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    if a is True or b is True:
        return b if a is True else a
    if a is False or b is False:
        return False
    return ops.logical_and(a, b)


def flag(condition, dtype):
    """A boolean scalar (or Python bool) as 0/1 of `dtype`."""
    if isinstance(condition, bool):
        return int(condition)
    return ops.cast(condition, dtype)


def finite(grads):
    """True when no gradient holds a NaN or an Inf (exact).

    Eagerly (PyTorch) a NaN or an Inf propagates into a sum: one reduction
    per gradient, no boolean tensor; the elementwise test runs only if a
    float32 sum overflowed (as the TensorFlow driver's `all_finite`)."""
    if EAGER:
        sums = ops.stack([ops.sum(ops.cast(g, "float32")) for g in grads])
        if bool(ops.all(ops.isfinite(sums))):
            return True
    checks = [ops.all(ops.isfinite(g)) for g in grads]
    result = checks[0]
    for check in checks[1:]:
        result = ops.logical_and(result, check)
    return result


if IN_PLACE:
    import torch


def compiling():
    """True while `torch.compile` traces the step (a `model.compile` with
    `jit_compile=True` under PyTorch): a count read as a number there is
    symbolic, not a Python int."""
    return IN_PLACE and torch.compiler.is_compiling()


def _in_place():
    """PyTorch, outside a `keras.StatelessScope` (whose writes go to the
    scope: `stateless_apply` must leave the variables as they are)."""
    return IN_PLACE and not _compat.in_stateless_scope()


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _values(variables):
    """The torch tensors behind Keras variables (written in place)."""
    return [v.value for v in variables]


def adam_moments(
    momentums, velocities, grads, rate_1, rate_2, keep=True, changes=equations.adam_moment_changes
):
    """m = m + (g - m)(1 - beta_1), v = v + (g**2 - v)(1 - beta_2) for each
    variable (`rate_i` = 1 - beta_i; `changes` gives the two terms added),
    written where `keep` holds.

    In place under PyTorch as Keras's PyTorch Adam writes it: m = m beta_1 +
    g (1 - beta_1) (equal to rounding)."""
    if _in_place() and keep is True and _is_number(rate_1) and _is_number(rate_2):
        with torch.no_grad():
            m, v = _values(momentums), _values(velocities)
            torch._foreach_mul_(m, 1 - rate_1)
            torch._foreach_add_(m, grads, alpha=rate_1)
            torch._foreach_mul_(v, 1 - rate_2)
            torch._foreach_addcmul_(v, grads, grads, value=rate_2)
        return
    if keep is False:
        return
    for m, v, g in zip(momentums, velocities, grads):
        change_m, change_v = changes(m, v, g, rate_1, rate_2)
        m.assign(masked(keep, m + change_m, m))
        v.assign(masked(keep, v + change_v, v))


def decayed_moments(momentums, velocities, grads, keep, take, fold):
    """InvariantAdam's fold: (m, v) = fold(m, v, g, keep, take), i.e. m keep_1
    + g take_1 and v keep_2 + g**2 take_2, for each variable. `keep` and
    `take` are pairs of scalars; under PyTorch the same sums are written in
    place (`_foreach`; a keep of exactly 1, inside a window, skips the
    multiply)."""
    (keep_1, keep_2), (take_1, take_2) = keep, take
    if _in_place() and all(_is_number(x) for x in (keep_1, keep_2, take_1, take_2)):
        with torch.no_grad():
            m, v = _values(momentums), _values(velocities)
            if keep_1 != 1.0:
                torch._foreach_mul_(m, keep_1)
            if keep_2 != 1.0:
                torch._foreach_mul_(v, keep_2)
            torch._foreach_add_(m, grads, alpha=take_1)
            torch._foreach_addcmul_(v, grads, grads, value=take_2)
        return
    for m, v, g in zip(momentums, velocities, grads):
        cast = lambda pair, dtype=m.dtype: tuple(ops.cast(x, dtype) for x in pair)
        m_new, v_new = fold(m, v, g, cast(keep), cast(take))
        m.assign(m_new)
        v.assign(v_new)


def _step_terms(momentums, velocities, alphas, epsilon):
    """(alpha m, sqrt(v) + epsilon) per variable, as new torch tensors:
    the numerator and denominator of Adam's step (PyTorch, in place on
    the temporaries)."""
    m, v = _values(momentums), _values(velocities)
    denominators = torch._foreach_sqrt(v)
    torch._foreach_add_(denominators, epsilon)
    if all(alpha is alphas[0] for alpha in alphas):  # one dtype
        return torch._foreach_mul(m, alphas[0]), denominators
    return [x * alpha for x, alpha in zip(m, alphas)], denominators


def adam_steps(momentums, velocities, alphas, epsilon):
    """[alpha m / (sqrt(v) + epsilon)] for each variable (`alphas`: one
    scalar per variable, in its dtype)."""
    if _in_place():
        with torch.no_grad():
            scaled, denominators = _step_terms(momentums, velocities, alphas, epsilon)
            torch._foreach_div_(scaled, denominators)
            return scaled
    return [
        equations.adam_step(m, v, alpha, epsilon)
        for m, v, alpha in zip(momentums, velocities, alphas)
    ]


def add_adam_steps(updates, momentums, velocities, alphas, epsilon, start, keep=True):
    """A = step at the window's start, else A + step, for each variable:
    `window_sums` of `adam_steps`, the step 0 where `keep` does not hold.
    Under PyTorch one fused `torch._foreach_addcdiv_` adds alpha m /
    (sqrt(v) + epsilon) into A in place, with no temporary for the step
    itself."""
    if keep is False:  # eager, a skipped micro-step: A = 0 at the window's start
        window_sums(updates, [ops.zeros_like(ops.convert_to_tensor(a)) for a in updates], start)
        return
    if keep is not True:  # traced: where(keep, step, 0)
        steps = adam_steps(momentums, velocities, alphas, epsilon)
        window_sums(updates, [ops.where(keep, x, ops.zeros_like(x)) for x in steps], start)
        return
    if _in_place() and isinstance(start, bool):
        with torch.no_grad():
            scaled, denominators = _step_terms(momentums, velocities, alphas, epsilon)
            targets = _values(updates)
            if start:
                torch._foreach_zero_(targets)
            torch._foreach_addcdiv_(targets, scaled, denominators)
        return
    window_sums(updates, adam_steps(momentums, velocities, alphas, epsilon), start)


def window_sum(total, value, start):
    """S = value at the window's start, else S + value (`start` a boolean
    scalar, or a Python bool where the step runs eagerly)."""
    if isinstance(start, bool):
        return value if start else total + value
    return ops.where(start, value, total + value)


def window_sums(totals, values, start):
    """S = value at the window's start, else S + value, for each pair
    (`window_sum`)."""
    if _in_place() and isinstance(start, bool):
        with torch.no_grad():
            targets = _values(totals)
            if start:
                torch._foreach_copy_(targets, values)
            else:
                torch._foreach_add_(targets, values)
        return
    for total, value in zip(totals, values):
        total.assign(window_sum(total, value, start))


def subtract(variables, deltas, keep=True, decays=None):
    """theta = theta - delta for each variable, where `keep` holds. With
    `decays` (per variable None, or the (weight_decay, lr) of
    `equations.decayed`) theta is decayed first: decayed(theta) - delta."""
    decays = decays or [None] * len(variables)
    if _in_place() and keep is True:
        values = _values(variables)
        with torch.no_grad():
            if any(d.dtype != x.dtype for d, x in zip(deltas, values)):
                for x, d, decay in zip(values, deltas, decays):
                    x.copy_(minus(x, d, decay))
                return
            for x, decay in zip(values, decays):
                if decay is not None:
                    x.copy_(equations.decayed(x, *decay))
            torch._foreach_sub_(values, deltas)
        return
    if keep is False:
        return
    for variable, delta, decay in zip(variables, deltas, decays):
        theta = minus(ops.convert_to_tensor(variable), delta, decay)
        variable.assign(masked(keep, theta, variable))


def minus(theta, delta, decay=None):
    """decayed(theta) - delta (`decay`: None, or the (weight_decay, lr) of
    `equations.decayed`, in delta's dtype) in theta's dtype. A float32
    delta of a bfloat16 or float16 theta (float32 state) is applied in
    float32 and rounded once, at the write."""
    if delta.dtype == theta.dtype:
        return (theta if decay is None else equations.decayed(theta, *decay)) - delta
    wide = ops.cast(theta, delta.dtype)
    wide = wide if decay is None else equations.decayed(wide, *decay)
    return ops.cast(wide - delta, theta.dtype)


def update_ema(optimizer, keep=True, replicas=1):
    """After an update (where `keep` holds), Keras's EMA step of the
    weights: average = rho average + (1 - rho) theta (the first update
    copies theta), rho the rule's momentum of one window
    (`_ema_momentum_of_window(replicas)`) or Keras's `ema_momentum`; then,
    every `ema_overwrite_frequency` updates, theta = average. Every driver
    writes the EMA with this (TensorFlow in cross-replica context)."""
    trained = _compat.trainable_variables(optimizer)
    averages = _compat.ema_averages(optimizer)
    rho = optimizer._ema_momentum_of_window(replicas)
    rho = optimizer.ema_momentum if rho is None else rho
    not_first = ops.not_equal(ops.convert_to_tensor(optimizer.iterations), 0)
    for var, average in zip(trained, averages):
        if average is not None:
            factor = rho if isinstance(rho, float) else ops.cast(rho, var.dtype)
            momentum = ops.cast(not_first, var.dtype) * factor  # Keras's form
            average.assign(masked(keep, momentum * average + (1 - momentum) * var, average))
    frequency = optimizer.ema_overwrite_frequency
    if frequency:
        due = both(keep, ops.equal((optimizer.iterations + 1) % frequency, 0))
        for var, average in zip(trained, averages):
            if average is not None:
                var.assign(masked(due, average, var))
