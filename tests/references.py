"""Numpy references (float64) written from the update equations.

Each works on lists of arrays (one per variable) and is driven one
micro-batch at a time, like the optimizers: `apply(params, grads)` returns
the parameters after that micro-batch. A micro-batch whose gradients are not
all finite is skipped as the `"skip_micro_batch"` policy defines it.
"""

import math

import numpy as np


def clip(grads, clipnorm=None, clipvalue=None, global_clipnorm=None):
    """Keras's clipping: per tensor norm, global norm, or by value."""
    if clipnorm:
        return [g * clipnorm / max(np.linalg.norm(g), clipnorm) for g in grads]
    if global_clipnorm:
        norm = np.sqrt(sum(np.sum(g * g) for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    if clipvalue:
        return [np.clip(g, -clipvalue, clipvalue) for g in grads]
    return grads


def finite(grads):
    return all(np.all(np.isfinite(g)) for g in grads)


class Adam:
    """`keras.optimizers.Adam`: clip, decay theta by lr * weight_decay, then
    m += (g - m)(1 - b1), v += (g^2 - v)(1 - b2),
    theta -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)."""

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.0, **clipping):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.clipping, self.t, self.m, self.v = clipping, 0, None, None

    def alpha(self, t):
        return self.lr * np.sqrt(1 - self.b2**t) / (1 - self.b1**t)

    def fold(self, grads):
        """One gradient into the moments (t += 1); returns m / (sqrt v + eps)."""
        if self.m is None:
            self.m, self.v = [0 * g for g in grads], [0 * g for g in grads]
        self.t += 1
        self.m = [m + (g - m) * (1 - self.b1) for g, m in zip(grads, self.m)]
        self.v = [v + (g * g - v) * (1 - self.b2) for g, v in zip(grads, self.v)]
        return [m / (np.sqrt(v) + self.eps) for m, v in zip(self.m, self.v)]

    def decay(self, params):
        return [p - p * self.wd * self.lr for p in params]

    def apply(self, params, grads):
        direction = self.fold(clip(grads, **self.clipping))
        return [p - self.alpha(self.t) * d for p, d in zip(self.decay(params), direction)]


class GradientAccumulation:
    """S = sum_j w_j g_j, W = sum_j w_j over a window of `steps`; at its end
    `inner.apply(params, S / W)` (nothing when every micro-batch skipped)."""

    def __init__(self, inner, steps):
        self.inner, self.steps, self.calls = inner, steps, 0
        self.total, self.weight = None, 0.0

    def apply(self, params, grads, weight=1.0):
        if self.calls % self.steps == 0:
            self.total, self.weight = [0 * p for p in params], 0.0
        self.calls += 1
        if finite(grads):
            self.total = [s + weight * g for s, g in zip(self.total, grads)]
            self.weight += weight
        if self.calls % self.steps or self.weight == 0:
            return params
        return self.inner.apply(params, [s / self.weight for s in self.total])


class UpdateAccumulationAdam(Adam):
    """Per micro-batch: clip, fold g into m and v (t counts folds), and
    A += alpha_t m / (sqrt v + eps); every `steps`: decay, theta -= A."""

    def __init__(self, lr, steps, **kwargs):
        super().__init__(lr, **kwargs)
        self.steps, self.calls, self.update = steps, 0, None

    def apply(self, params, grads):
        if self.calls % self.steps == 0:
            self.update = [0 * p for p in params]
        self.calls += 1
        if finite(grads):
            direction = self.fold(clip(grads, **self.clipping))
            self.update = [a + self.alpha(self.t) * d for a, d in zip(self.update, direction)]
        if self.calls % self.steps:
            return params
        return [p - a for p, a in zip(self.decay(params), self.update)]


class InvariantAdam(Adam):
    """Over a window of kappa micro-batches (clipped each, a skipped one is a
    zero gradient): m = b1 m + (1 - b1) mean_j g_j,
    v = b2 v + (1 - b2) mean_j g_j^2; then decay and
    theta -= lr sqrt(1 - b2^k) / (1 - b1^k) m / (sqrt(v) + eps)."""

    def __init__(self, lr, kappa, **kwargs):
        super().__init__(lr, **kwargs)
        self.kappa, self.window = kappa, []

    def apply(self, params, grads):
        grads = clip(grads, **self.clipping) if finite(grads) else [0 * p for p in params]
        self.window.append(grads)
        if len(self.window) < self.kappa:
            return params
        mean = [np.mean(gs, 0) for gs in zip(*self.window)]
        square = [np.mean(np.square(gs), 0) for gs in zip(*self.window)]
        self.window, self.t = [], self.t + 1
        if self.m is None:
            self.m, self.v = [0 * g for g in mean], [0 * g for g in mean]
        self.m = [self.b1 * m + (1 - self.b1) * g for m, g in zip(self.m, mean)]
        self.v = [self.b2 * v + (1 - self.b2) * s for v, s in zip(self.v, square)]
        step = [m / (np.sqrt(v) + self.eps) for m, v in zip(self.m, self.v)]
        return [p - self.alpha(self.t) * d for p, d in zip(self.decay(params), step)]


class SGD:
    """theta -= lr g."""

    def __init__(self, lr):
        self.lr = lr

    def apply(self, params, grads):
        return [p - self.lr * g for p, g in zip(params, grads)]


def scheduled_invariant_adam(
    theta, windows, lr, b1, b2, eps=1e-7, rule=None, lr_fn=None, weight_decay=None, ema=None
):
    """InvariantAdam when window k holds kappa_k = len(windows[k]) micro-batch
    gradients (arrays [kappa_k, ...], one variable). With `rule`, lr, b1, b2
    are the values for kappa = 1 and window k uses lr_k = kappa_k lr and
    1 - b_k = kappa_k (1 - b) ("invariant"), b_k = b ** kappa_k ("power") or
    b1 kept and b2 ** kappa_k ("fixed_beta_1"); the bias correction uses
    P_i = prod of the betas applied. `lr_fn(n)` replaces lr: n =
    micro-batches before the window (rule) or updates. `weight_decay`:
    theta *= 1 - lr_k weight_decay before the step. `ema` (a momentum rho):
    returns (theta, average), average = rho_k average + (1 - rho_k) theta
    after each update, rho_k = rho ** kappa_k with a rule (0 at the first)."""
    m = v = np.zeros_like(theta)
    p1 = p2 = 1.0
    consumed = 0
    average = None
    for k, g in enumerate(windows):
        kappa = len(g)
        base = lr_fn(consumed if rule else k) if lr_fn else lr
        if rule is None:
            lr_k, b1k, b2k = base, b1, b2
        elif rule == "invariant":
            lr_k, b1k, b2k = kappa * base, 1 - kappa * (1 - b1), 1 - kappa * (1 - b2)
        elif rule == "power":
            lr_k, b1k, b2k = kappa * base, b1**kappa, b2**kappa
        else:
            assert rule == "fixed_beta_1", rule
            lr_k, b1k, b2k = kappa * base, b1, b2**kappa
        m = b1k * m + (1 - b1k) * g.mean(0)
        v = b2k * v + (1 - b2k) * (g**2).mean(0)  # square, then average
        p1, p2 = p1 * b1k, p2 * b2k
        if weight_decay:
            theta = theta - lr_k * weight_decay * theta
        theta = theta - lr_k * np.sqrt(1 - p2) / (1 - p1) * m / (np.sqrt(v) + eps)
        if ema is not None:
            rho = 0.0 if k == 0 else (ema**kappa if rule else ema)
            average = theta if k == 0 else rho * average + (1 - rho) * theta
        consumed += kappa
    return theta if ema is None else (theta, average)


def window_batch_norm(batches, sizes, momentum, mean, variance, masks=None):
    """`keras_accum.layers.BatchNormalization`'s moving statistics after the
    micro-batches `batches` (activations [n_i, ..., C]; `masks`: per item
    weights 0 or 1, or None) in windows of `sizes[k]` micro-batches in turn
    (a last partial window moves nothing). Micro-batch i: n_i items, mean
    mu_i, biased variance s_i^2; S1 += n_i mu_i, S2 += n_i (s_i^2 + mu_i^2),
    N += n_i; at a window's end mu = S1 / N, s^2 = S2 / N - mu^2,
    M = m M + (1 - m) mu, V = m V + (1 - m) s^2."""
    mean, variance = np.float64(mean), np.float64(variance)
    masks = masks or [None] * len(batches)
    start = 0
    for size in sizes:
        if start + size > len(batches):
            break
        s1 = s2 = n = 0.0
        for x, w in zip(batches[start : start + size], masks[start : start + size]):
            x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
            w = np.ones(len(x)) if w is None else np.asarray(w, np.float64).reshape(-1)
            n_i = w.sum()
            mu_i = (w[:, None] * x).sum(0) / n_i
            var_i = (w[:, None] * (x - mu_i) ** 2).sum(0) / n_i
            s1, s2, n = s1 + n_i * mu_i, s2 + n_i * (var_i + mu_i**2), n + n_i
        start += size
        mu = s1 / n
        mean = momentum * mean + (1 - momentum) * mu
        variance = momentum * variance + (1 - momentum) * (s2 / n - mu**2)
    return mean, variance


def window_batch_norm_state(batches, sizes, momentum, mean, variance, unit="update", masks=None):
    """The whole state of `keras_accum.layers.BatchNormalization` after the
    micro-batches `batches` in windows of `sizes[k]` micro-batches in turn
    (the last one may be partial): (moving mean, moving variance, S1, S2, N)
    with the sums of the window in progress around the shift c = moving
    mean: S1 = sum n_i (mu_i - c), S2 = sum n_i (s_i^2 + (mu_i - c)^2),
    N = sum n_i (per channel). A window of k micro-batches moves the
    statistics with momentum m ** k (`unit="micro_step"`) or m
    (`unit="update"`)."""
    mean, variance = np.float64(mean), np.float64(variance)
    masks = masks or [None] * len(batches)
    channels = np.shape(batches[0])[-1]
    i = 0
    for size in sizes:
        s1, s2, n = np.zeros(channels), np.zeros(channels), np.zeros(channels)
        window = list(zip(batches[i : i + size], masks[i : i + size]))
        for x, w in window:
            x = np.asarray(x, np.float64).reshape(-1, channels)
            w = np.ones(len(x)) if w is None else np.asarray(w, np.float64).reshape(-1)
            n_i = w.sum()
            mu_i = (w[:, None] * x).sum(0) / n_i
            var_i = (w[:, None] * (x - mu_i) ** 2).sum(0) / n_i
            s1, s2, n = s1 + n_i * (mu_i - mean), s2 + n_i * (var_i + (mu_i - mean) ** 2), n + n_i
        i += size
        if len(window) < size:  # the window in progress
            return mean, variance, s1, s2, n
        m = momentum**size if unit == "micro_step" else momentum
        shifted = s1 / n
        mean, variance = (
            m * mean + (1 - m) * (mean + shifted),
            m * variance + (1 - m) * (s2 / n - shifted**2),
        )
        if i == len(batches):
            break
    zeros = np.zeros(channels)
    return mean, variance, zeros, zeros, zeros


def adaptive_steps(estimates, floor, top, unit, s, settle, first, pow2=False):
    """(B_n, n, steps) after each estimate: a_n = s a + (1 - s) clip(b, 0,
    top x unit) over the non-nan estimates, B_n = a_n / (1 - s^n), and once
    n >= settle, steps = max(steps, clip(ceil(B_n / unit), floor, top))."""
    acc, n, steps, out = 0.0, 0, first, []
    for b in estimates:
        if not math.isnan(b):
            acc = s * acc + (1 - s) * min(max(b, 0.0), top * unit)
            n += 1
        smoothed = acc / (1 - s**n) if n else math.nan
        if n >= settle:
            target = math.ceil(smoothed / unit)
            if pow2:  # the next power of two
                target = 2 ** math.ceil(math.log2(max(target, 1)))
            steps = max(steps, min(max(target, floor), top))
        out.append((smoothed, n, steps))
    return out
