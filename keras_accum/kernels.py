"""The writes and flags the rules use on JAX and PyTorch, list-wise.

JAX: `keras.ops` per variable, flags boolean tensors (`where` masks).
PyTorch: eager, flags Python bools (`decided`), in-place `torch._foreach_*`
as Keras's `torch_adam.py`. The backend is asked here once (`IN_PLACE`).
"""

import numbers

from keras import ops

from keras_accum import _backend, _compat, equations

IN_PLACE = _backend.BACKEND == "torch"

# PyTorch: flags are Python bools, a window's end a Python `if`. JAX traces:
# flags stay boolean tensors, every write `where(keep, new, old)`.
EAGER = IN_PLACE


def decided(condition):
    """`condition` as a Python bool on PyTorch; unchanged under JAX."""
    if EAGER and not isinstance(condition, bool):
        return bool(condition)
    return condition


def masked(keep, new, old):
    """`new` where `keep` holds, else `old` (picked now for a bool)."""
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
    """True when no gradient holds a NaN or an Inf (exact). Eagerly, sums
    first; the elementwise test only if one overflowed (as `all_finite`)."""
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
    """True while `torch.compile` traces (`jit_compile=True`): counts are
    symbolic there."""
    return IN_PLACE and torch.compiler.is_compiling()


def _in_place():
    """PyTorch, outside a `keras.StatelessScope` (whose writes go to it)."""
    return IN_PLACE and not _compat.in_stateless_scope()


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _values(variables):
    """The torch tensors behind Keras variables (written in place)."""
    return [v.value for v in variables]


def adam_moments(
    momentums, velocities, grads, rate_1, rate_2, keep=True, changes=equations.adam_moment_changes
):
    """m += (g - m)(1 - beta_1), v += (g**2 - v)(1 - beta_2) where `keep`
    holds (`rate_i` = 1 - beta_i). PyTorch in place, as Keras's torch Adam:
    m = m beta_1 + g (1 - beta_1) (equal to rounding)."""
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
    """InvariantAdam's fold: m = m keep_1 + g take_1, v = v keep_2 + g**2
    take_2 (scalar pairs); PyTorch in place, a keep of 1 skips the multiply."""
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
    """(alpha m, sqrt(v) + epsilon) per variable, new torch tensors."""
    m, v = _values(momentums), _values(velocities)
    denominators = torch._foreach_sqrt(v)
    torch._foreach_add_(denominators, epsilon)
    if all(alpha is alphas[0] for alpha in alphas):  # one dtype
        return torch._foreach_mul(m, alphas[0]), denominators
    return [x * alpha for x, alpha in zip(m, alphas)], denominators


def adam_steps(momentums, velocities, alphas, epsilon):
    """[alpha m / (sqrt(v) + epsilon)], one alpha per variable."""
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
    """A = step at the window's start, else A + step (step 0 where `keep`
    fails); PyTorch: one in-place `_foreach_addcdiv_`."""
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
    """S = value at the window's start, else S + value."""
    if isinstance(start, bool):
        return value if start else total + value
    return ops.where(start, value, total + value)


def window_sums(totals, values, start):
    """`window_sum` for each pair, written."""
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
    """theta = decayed(theta) - delta where `keep` holds (`decays`: per
    variable None or `equations.decayed`'s (weight_decay, lr))."""
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
    """decayed(theta) - delta in theta's dtype; a wider delta is applied in
    its dtype and rounded once."""
    if delta.dtype == theta.dtype:
        return (theta if decay is None else equations.decayed(theta, *decay)) - delta
    wide = ops.cast(theta, delta.dtype)
    wide = wide if decay is None else equations.decayed(wide, *decay)
    return ops.cast(wide - delta, theta.dtype)


def update_ema(optimizer, keep=True, replicas=1):
    """Keras's EMA step after an update, where `keep` holds (every driver):
    average = rho average + (1 - rho) theta (the first copies theta), rho
    `_ema_momentum_of_window` or `ema_momentum`; theta = average every
    `ema_overwrite_frequency` updates."""
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
