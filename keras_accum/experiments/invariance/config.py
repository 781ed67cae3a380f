"""The invariance study's config: defaults, validation, the methods."""

import keras_accum as ka
from keras_accum.experiments import config as cfg
from keras_accum.experiments import models, optimizers

METHODS = ("invariant", "power", "fixed_beta_1", "sqrt", "update_accumulation", "plain")
# The default study: the linear rule against the baselines.
DEFAULT_METHODS = ["invariant", "sqrt", "update_accumulation", "plain"]

F = cfg.Field


def _bounded_int(minimum):
    return F("", "int", minimum, "", minimum=minimum)


FIELDS = [
    F("dataset", "str", "mnist1d", "TFDS name (mnist1d is built offline)"),
    F("data_dir", "path", None, "TFDS data_dir"),
    F("model", "str", "mlp", "Model name", choices=tuple(models.MODELS)),
    F("micro_batch_size", "int", 32, "Items per micro-batch", minimum=1),
    F("kappas", "list", [1, 2, 4, 8], "Micro-batches per update", item=_bounded_int(1)),
    cfg.names("methods", DEFAULT_METHODS, "Methods", METHODS),
    # Base hyperparameters at kappa = 1; each method rescales them.
    F("learning_rates", "list", [3e-4, 1e-3, 3e-3], "Base learning rates", item=cfg.POSITIVE),
    cfg.fraction("beta_1", 0.9, "Adam beta_1 at kappa = 1"),
    cfg.fraction("beta_2", 0.999, "Adam beta_2 at kappa = 1"),
    F("epsilon", "float", 1e-7, "Adam epsilon", minimum=0.0, open_minimum=True),
    F("seeds", "list", [0, 1, 2], "Seeds", item=_bounded_int(0)),
    F("train_examples", "int", 16384, "Examples seen per run", minimum=1),
    # A multiple of max(kappas) x micro_batch_size: every kappa is at a
    # window end at each evaluation point.
    F("eval_every", "int", 1024, "Examples between evaluations", minimum=1),
    F("train_eval_examples", "int", 1000, "Fixed train subset for the train loss", minimum=1),
    F("share_kappa1", "bool", True, "Run kappa = 1 once for all methods (all are Adam there)"),
    F("plot_learning_rates", "list", [1e-3], "A curves figure each", minimum=0, item=cfg.POSITIVE),
    # B_simple probes: windows of `noise_scale_kappa` micro-batches.
    F("noise_scale_windows", "int", 32, "B_simple probe windows", minimum=1),
    F("noise_scale_kappa", "int", 8, "Micro-batches per probe window", minimum=2),
    # Bias-corrected EMA over probes of a fixed model: 0.99 weights the
    # windows nearly uniformly (the tracker is built for moving models).
    cfg.fraction("noise_scale_ema", 0.99, "EMA of the B_simple probes"),
    F("verbose", "int", 1, "1: a line per run, 0: silent", choices=(0, 1)),
]


def _check_plot_learning_rates(c):
    missing = [lr for lr in c["plot_learning_rates"] if lr not in c["learning_rates"]]
    if missing:
        raise ValueError(
            "`plot_learning_rates` must be among `learning_rates`. "
            f"Received: plot_learning_rates={c['plot_learning_rates']!r}"
        )


def _check_evaluation_points(c):
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
            f"train_examples={c['train_examples']}, eval_every={c['eval_every']}"
        )


def _check_rules(c):
    # Fail now, not after an hour of runs.
    for kappa in c["kappas"]:
        for method in c["methods"]:
            optimizer_hyperparameters(method, kappa, 1e-3, c["beta_1"], c["beta_2"], c["epsilon"])


SCHEMA = cfg.Schema(
    "invariance study",
    FIELDS,
    [_check_plot_learning_rates, _check_evaluation_points, _check_rules],
)
DEFAULTS = SCHEMA.defaults()


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values
    (`keras_accum.experiments.config.ConfigError`, a ValueError)."""
    return SCHEMA.resolve(config)


# -- optimizers ---------------------------------------------------------------


# Each method: (optimizer name, scaling rule from the kappa = 1 base).
# power and fixed_beta_1 are InvariantAdam under the other rules (where does
# each rule's invariance break?). update_accumulation keeps lr as a
# per-micro-batch rate, unscaled by design; plain does no rescaling at all
# (the naive baseline).
METHOD_OPTIMIZERS = {
    "invariant": ("invariant_adam", "invariant"),
    "power": ("invariant_adam", "power"),
    "fixed_beta_1": ("invariant_adam", "fixed_beta_1"),
    "sqrt": ("gradient_accumulation", "sqrt"),
    "update_accumulation": ("update_accumulation_adam", None),
    "plain": ("gradient_accumulation", None),
}


def optimizer_hyperparameters(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The Adam hyperparameters `method` uses at `kappa` from the base ones."""
    _, rule = METHOD_OPTIMIZERS[cfg.validation.check_choice("method", method, METHODS)]
    base = {"learning_rate": base_lr, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon}
    return ka.scale_hyperparameters(kappa, rule, **base) if rule else base


def method_optimizer(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The optimizer of `method` for kappa micro-batches per update."""
    h = optimizer_hyperparameters(method, kappa, base_lr, beta_1, beta_2, epsilon)
    return optimizers.build(METHOD_OPTIMIZERS[method][0], kappa, h)
