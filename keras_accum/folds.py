"""Each optimizer's per-micro-batch arithmetic, written once.

Plain functions of gradients, state and scalars; `keras_accum._execution`
decides how they run. `start` and `ok` are Python bools (inside a branch
that already knows them) or boolean tensors (a select), see
`_execution.where`. Functions that take `handles` read and write variables
through their resource handles, so that `_execution.run` can compile them
into one kernel and, in replica context, each replica writes its own copy.

| optimizer                | fold                                     |
|--------------------------|------------------------------------------|
| `GradientAccumulation`   | `add_to_window` (dense and sparse)       |
| `InvariantAdam`          | `fold_moments`, `fold_rows` (sparse),    |
|                          | `keras_moments` (one micro-batch a window: |
|                          | Keras Adam's own form and rounding)      |
| `UpdateAccumulationAdam` | `adam_micro_step`                        |
"""

from keras_accum import _replicas, _tensors, equations
from keras_accum._backend import tf
from keras_accum._execution import where


def add_to_window(state, value, start):
    """S = value at the window's start, else S + value, in place.

    `value`: a tensor, a `tf.IndexedSlices` (its rows are added where they
    fall, no dense gradient) or None (a skipped micro-batch: nothing is
    added, and S = 0 at the window's start whatever came before)."""
    if value is None or isinstance(value, tf.IndexedSlices):
        if start is True:
            state.assign(_tensors.zeros_like_state(state))
        elif start is not False:  # S = 0 at the start, fused, in place
            state.assign(tf.where(start, tf.zeros((), state.dtype), state))
        if value is not None:
            _replicas.scatter_add(state, value)
    elif start is True:
        state.assign(value)
    elif start is False:
        state.assign_add(value)
    else:
        state.assign(equations.window_sum(state, value, start))


def _read(handle, dtype):
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def _assign(handle, value):
    tf.raw_ops.AssignVariableOp(resource=handle, value=value)


def fold_moments(grads, m_handles, v_handles, scalars, ok=None):
    """InvariantAdam's fold of one micro-batch's dense gradients.

    `scalars` = (steps, square_factor, rate_1, rate_2, first), float32
    scalars: g / steps enters the mean gradient, g**2 * square_factor the
    mean squared gradient, rate_i = 1 - beta_i of the window, first = 1 at
    the window's first micro-batch (the decay), else 0. `ok` (optional
    boolean scalar): False counts the micro-batch as a zero gradient.
    """
    steps, square_factor, rate_1, rate_2, first = scalars
    # m += (1 - beta_1) (g_j / kappa - [window start] m), i.e.
    # m = m (1 - first rate_1) + g (rate_1 / steps); v likewise with g**2.
    # The scalars are computed once; a skipped micro-batch gets a zero
    # factor, and `multiply_no_nan` makes its NaN or Inf times 0 exactly 0.
    keep_1, keep_2 = 1.0 - first * rate_1, 1.0 - first * rate_2
    take_1, take_2 = rate_1 / steps, rate_2 * square_factor
    if ok is not None:
        take_1 = tf.where(ok, take_1, 0.0)
        take_2 = tf.where(ok, take_2, 0.0)
    for g, m_handle, v_handle in zip(grads, m_handles, v_handles):
        dtype = g.dtype
        m, v = _read(m_handle, dtype), _read(v_handle, dtype)
        cast = lambda *xs, dtype=dtype: tuple(tf.cast(x, dtype) for x in xs)
        keep, take = cast(keep_1, keep_2), cast(take_1, take_2)
        m, v = equations.decayed_moments(m, v, g, keep, take, times=tf.math.multiply_no_nan)
        _assign(m_handle, m)
        _assign(v_handle, v)


def fold_rows(grads, moments, scalars, start, ok=None):
    """`fold_moments` for sparse gradients (`tf.IndexedSlices`), row by row:
    the decay of the window's first micro-batch (where `start` holds), then
    m[rows] += (1 - beta_1) g_j / kappa and v[rows] += (1 - beta_2)
    g_j**2 / kappa, the square taken after repeated rows are summed, as for
    the dense gradient."""
    steps, square_factor, rate_1, rate_2, _ = scalars
    first = where(start, 1.0, 0.0) if isinstance(start, bool) else tf.cast(start, "float32")
    take_1, take_2 = rate_1 / steps, rate_2 * square_factor
    if ok is not None:
        take_1 = tf.where(ok, take_1, 0.0)
        take_2 = tf.where(ok, take_2, 0.0)
    for g, (m, v) in zip(grads, moments):
        dtype = m.dtype
        scalar = lambda x, dtype=dtype: tf.cast(x, dtype)
        if start is not False:  # the window's decay
            m.assign(m * scalar(1.0 - first * rate_1))
            v.assign(v * scalar(1.0 - first * rate_2))
        rows, values = _tensors.combine_rows(g)
        if ok is not None:  # a skipped micro-batch's NaN rows: zeros
            values = tf.where(ok, values, tf.zeros((), dtype))
        shape = g.dense_shape
        _replicas.scatter_add(m, tf.IndexedSlices(values * scalar(take_1), rows, shape))
        _replicas.scatter_add(v, tf.IndexedSlices(tf.square(values) * scalar(take_2), rows, shape))


def keras_moments(grads, moments, rate_1, rate_2, replicas, assign_add):
    """Every micro-batch a window: m = m + (g_j / kappa - m)(1 - beta_1) and
    v likewise with g_j**2, in `keras.optimizers.Adam`'s own form and
    rounding (so that one replica is Keras Adam bit for bit); written with
    `assign_add(variable, delta)`."""
    for g, (m, v) in zip(grads, moments):
        # g_j**2 / kappa = g**2 * replicas (the replica factor undone)
        square = None if replicas == 1 else tf.square(g) * float(replicas)
        b1, b2 = _cast(rate_1, m.dtype), _cast(rate_2, m.dtype)
        change_m, change_v = equations.adam_moment_changes(m, v, g, b1, b2, square)
        assign_add(m, change_m)
        assign_add(v, change_v)


def adam_micro_step(grads, handles, scalars, start, keep=True):
    """UpdateAccumulationAdam's micro-step for every variable: Adam's
    moments, then A = step (window start) or A + step; with no buffer A
    (every window one micro-step) theta = theta - step, after the decoupled
    weight decay, as `keras.optimizers.Adam` does.

    `handles`: (m, v, A or None, theta, decays) per variable, decays the
    weight decay factor (or None); `scalars` = (alpha, rate_1, rate_2,
    epsilon, learning_rate): the bias-corrected rate of this micro-step (by
    dtype name: a variable's own dtype without a buffer, as Keras Adam
    computes it, else "float32"), 1 - beta_1, 1 - beta_2, epsilon and the
    learning rate, float32. `keep`
    False (a skipped micro-step): m, v and theta unchanged, A = 0 at the
    window's start.
    """
    alphas, rate_1, rate_2, epsilon, learning_rate = scalars
    for g, (m_handle, v_handle, a_handle, theta_handle, decay) in zip(grads, handles):
        dtype = g.dtype
        alpha = alphas.get(dtype.name, alphas.get("float32"))
        cast = lambda x, dtype=dtype: tf.cast(x, dtype)
        factor = None if isinstance(keep, bool) else cast(keep)
        if keep is False:
            if a_handle is not None and start is not False:
                a = _read(a_handle, dtype)
                _assign(a_handle, where(start, _tensors.zeros_like_state(a), a))
            continue
        m, v = _read(m_handle, dtype), _read(v_handle, dtype)
        # m += (g - m)(1 - beta_1); v += (g**2 - v)(1 - beta_2)
        dm, dv = equations.adam_moment_changes(m, v, g, cast(rate_1), cast(rate_2))
        if factor is not None:  # a skipped micro-step moves nothing
            dm, dv = dm * factor, dv * factor
        m, v = m + dm, v + dv
        _assign(m_handle, m)
        _assign(v_handle, v)
        step = equations.adam_step(m, v, cast(alpha), cast(epsilon))
        if factor is not None:
            step = step * factor
        if a_handle is None:
            theta = _read(theta_handle, dtype)
            if decay is not None:
                # theta = theta - theta * weight_decay * lr
                rate = cast(learning_rate) if factor is None else cast(learning_rate) * factor
                theta = equations.decayed(theta, cast(decay), rate)
            _assign(theta_handle, theta - step)
            continue
        # A = step at the window's start, else A + step. Written as
        # (0 or A) + step: XLA then updates A in place (a select of two
        # parameter-sized results took one more buffer, 4 bytes/parameter).
        zero = tf.zeros((), dtype)
        a = zero if start is True else _read(a_handle, dtype)
        _assign(a_handle, where(start, zero, a) + step)


def _cast(value, dtype):
    """A tensor cast to `dtype`; a Python number as it is."""
    return value if isinstance(value, (int, float)) else tf.cast(value, dtype)
