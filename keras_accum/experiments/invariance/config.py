"""The invariance study's config: defaults, validation, the methods."""

import keras

import keras_accum as ka
from keras_accum.experiments import experiment

METHODS = ("invariant", "sqrt", "update_accumulation", "plain")

DEFAULTS = {
    "dataset": "mnist1d",
    "data_dir": None,
    "model": "mlp",
    "micro_batch_size": 32,
    "kappas": [1, 2, 4, 8],
    "methods": list(METHODS),
    # Base hyperparameters at kappa = 1; each method rescales them.
    "learning_rates": [3e-4, 1e-3, 3e-3],
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "seeds": [0, 1, 2],
    "train_examples": 16384,  # examples seen per run
    "eval_every": 1024,  # examples; a multiple of max(kappas) x micro batch
    "train_eval_examples": 1000,  # fixed train subset for the train loss
    "share_kappa1": True,
    "plot_learning_rates": [1e-3],  # one curves_lr_*.png each
    # B_simple probes: windows of `noise_scale_kappa` micro-batches.
    "noise_scale_windows": 32,
    "noise_scale_kappa": 8,
    # Bias-corrected EMA over probes of a fixed model: 0.99 weights the
    # windows nearly uniformly (the tracker is built for moving models).
    "noise_scale_ema": 0.99,
    "verbose": 1,
}


def _is_int(value, low):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"Unknown config key(s) {unknown}. Valid keys: {', '.join(sorted(DEFAULTS))}"
        )
    c = {**DEFAULTS, **config}
    for key in ("kappas", "methods", "learning_rates", "seeds", "plot_learning_rates"):
        c[key] = list(c[key])
    for key in (
        "micro_batch_size",
        "train_examples",
        "eval_every",
        "train_eval_examples",
        "noise_scale_windows",
    ):
        if not _is_int(c[key], 1):
            raise ValueError(f"`{key}` must be an integer >= 1. Received: {key}={c[key]!r}")
    if not _is_int(c["noise_scale_kappa"], 2):
        raise ValueError(
            "`noise_scale_kappa` must be an integer >= 2. "
            f"Received: noise_scale_kappa={c['noise_scale_kappa']!r}"
        )
    if not c["kappas"] or not all(_is_int(k, 1) for k in c["kappas"]):
        raise ValueError(
            f"`kappas` must be a non-empty list of integers >= 1. Received: kappas={c['kappas']!r}"
        )
    bad = [m for m in c["methods"] if m not in METHODS]
    if bad or not c["methods"]:
        raise ValueError(
            f"`methods` must be a non-empty subset of "
            f"{list(METHODS)}. Received: methods={c['methods']!r}"
        )
    if not c["learning_rates"] or not all(
        isinstance(lr, (int, float)) and lr > 0 for lr in c["learning_rates"]
    ):
        raise ValueError(
            "`learning_rates` must be a non-empty list of "
            f"numbers > 0. Received: "
            f"learning_rates={c['learning_rates']!r}"
        )
    if not c["seeds"] or not all(_is_int(s, 0) for s in c["seeds"]):
        raise ValueError(
            f"`seeds` must be a non-empty list of integers >= 0. Received: seeds={c['seeds']!r}"
        )
    missing = [lr for lr in c["plot_learning_rates"] if lr not in c["learning_rates"]]
    if missing:
        raise ValueError(
            "`plot_learning_rates` must be among "
            f"`learning_rates`. Received: "
            f"plot_learning_rates={c['plot_learning_rates']!r}"
        )
    window = max(c["kappas"]) * c["micro_batch_size"]
    if c["eval_every"] % window:
        raise ValueError(
            f"`eval_every` must be a multiple of the largest window "
            f"max(kappas) x micro_batch_size = {window}, so that every kappa "
            f"is at a window end. Received: eval_every={c['eval_every']}"
        )
    if c["train_examples"] % c["eval_every"]:
        raise ValueError(
            "`train_examples` must be a multiple of `eval_every`. Received: "
            f"train_examples={c['train_examples']}, "
            f"eval_every={c['eval_every']}"
        )
    for kappa in c["kappas"]:  # Fail now, not after an hour of runs.
        for method in c["methods"]:
            optimizer_hyperparameters(method, kappa, 1e-3, c["beta_1"], c["beta_2"], c["epsilon"])
    return c


def load_config_file(path, variant):
    """`get_config(variant)` of a saved_configs/*.py file, or a run
    folder's config.json (then `variant` is ignored)."""
    return experiment.load_config_file(path, variant)


# -- optimizers ---------------------------------------------------------------


def optimizer_hyperparameters(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The Adam hyperparameters `method` uses at `kappa` from the base ones."""
    base = {"learning_rate": base_lr, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon}
    if method in ("invariant", "sqrt"):
        return ka.scale_hyperparameters(kappa, method, **base)
    if method in ("update_accumulation", "plain"):
        # update_accumulation: lr is a per-micro-batch rate, unscaled by
        # design; plain: no rescaling at all (the naive baseline).
        return base
    raise ValueError(f"`method` must be one of {list(METHODS)}. Received: method={method!r}")


def make_optimizer(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The optimizer of `method` for kappa micro-batches per update."""
    h = optimizer_hyperparameters(method, kappa, base_lr, beta_1, beta_2, epsilon)
    if method == "invariant":
        return ka.InvariantAdam(steps=kappa, **h)
    if method == "update_accumulation":
        return ka.UpdateAccumulationAdam(steps=kappa, **h)
    # sqrt (Malladi) and plain: standard accumulation of the mean gradient.
    return ka.GradientAccumulation(keras.optimizers.Adam(**h), steps=kappa)


# -- data ---------------------------------------------------------------------
