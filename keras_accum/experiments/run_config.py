"""The config of a training run: its fields, checks and the run-folder checks.

`SCHEMA` lists every key of a run (scripts/train.py derives its flags from
it); `resolve_config` fills the defaults and checks each value and the
combinations that need no data (scaling rule at kappa = steps, model
arguments, TF_CONFIG). `check_data`, `resume_config` and
`run_folder.check_new` finish the checks that need the dataset, the
strategy or the run folder; `experiment.train_and_evaluate` runs them all before it
writes anything.
"""

import inspect
import os
import pathlib

import keras_accum as ka
from keras_accum.experiments import config as cfg
from keras_accum.experiments import data, models, optimizers, run_folder
from keras_accum.training import distribute

OPTIMIZERS, INNER_OPTIMIZERS = optimizers.OPTIMIZERS, optimizers.INNER_OPTIMIZERS
STRATEGIES = ("default", "mirrored", "multi_worker")
F = cfg.Field

FIELDS = [
    F("dataset", "str", "mnist1d", "mnist1d, synthetic_tokens or a prepared TFDS name"),
    F("data_dir", "path", None, "TFDS data_dir (none: $TFDS_DATA_DIR or ~/tensorflow_datasets)"),
    F("model", "str", "cnn", "Model name", choices=tuple(models.MODELS)),
    F("model_kwargs", "dict", {}, "Keyword arguments of the model builder (JSON)"),
    F("optimizer", "str", "invariant_adam", "keras_accum optimizer", choices=OPTIMIZERS),
    F(
        "inner_optimizer",
        "str",
        "adam",
        "Wrapped optimizer of gradient_accumulation",
        choices=INNER_OPTIMIZERS,
    ),
    # Hyperparameters at kappa = 1; `scaling_rule` rescales them to kappa.
    F("learning_rate", "float", 1e-3, "Learning rate at kappa = 1", minimum=0.0, open_minimum=True),
    cfg.fraction("beta_1", 0.9, "Adam beta_1 at kappa = 1"),
    cfg.fraction("beta_2", 0.999, "Adam beta_2 at kappa = 1"),
    F("epsilon", "float", 1e-7, "Adam epsilon", minimum=0.0, open_minimum=True),
    F("weight_decay", "float", None, "Decoupled weight decay", minimum=0.0),
    F(
        "scaling_rule",
        "str",
        None,
        "Rescale lr/betas from kappa = 1 to steps x replicas",
        choices=(None,) + ka.scaling.RULES,
    ),
    # A schedule sees the update count, not micro-steps; cosine decays to 0.
    F(
        "lr_schedule",
        "str",
        "constant",
        "Learning-rate schedule over the updates",
        choices=("constant", "cosine"),
    ),
    F("micro_batch_size", "int", 32, "Items per micro-batch per replica", minimum=1),
    F("steps", "int", 4, "Micro-batches per update per replica", minimum=1),
    # A batch-size schedule (keras_accum.PiecewiseSteps); `steps` is then its
    # largest value, the unit of an epoch (a whole number of such windows).
    F(
        "steps_boundaries",
        "list",
        None,
        "Micro-steps per replica where the window size moves to the next of steps_values",
        item=F("", "int", 1, "", minimum=1),
    ),
    F(
        "steps_values",
        "list",
        None,
        "Window sizes of the schedule (one more than steps_boundaries; max = steps)",
        item=F("", "int", 1, "", minimum=1),
    ),
    F("epochs", "int", 10, "Epochs", minimum=1),
    # The first examples of train, the same for every seed; 0 = none (the
    # per-epoch evaluation then runs on test and is logged as test_*).
    cfg.fraction("validation_split", 0.0, "Fraction of train held out for validation"),
    F("seed", "int", 0, "Random seed", minimum=0, maximum=2**32 - 1),
    F("strategy", "str", "default", "tf.distribute strategy", choices=STRATEGIES),
    F("mixed_precision", "bool", False, "mixed_float16 policy"),
    F("jit_compile", "bool", False, "Compile the step with XLA"),
    # keras_accum.remat: less activation memory for about one more forward pass.
    F(
        "remat",
        "str",
        "none",
        "Recompute the model's layers in the backward pass",
        choices=ka.remat.MODES,
    ),
    F("noise_scale_every", "int", 0, "Batches between noise-scale probes (0: off)", minimum=0),
    F("verbose", "int", 1, "Keras verbosity", choices=(0, 1, 2)),
]


def _check_model_kwargs(config):
    builder = models.MODELS[config["model"]]
    valid = set(inspect.signature(builder).parameters) - {"input_shape", "num_classes"}
    unknown = sorted(set(config["model_kwargs"]) - valid)
    if unknown:
        raise cfg.ConfigError(
            f"`model_kwargs` of model {config['model']!r} accepts {', '.join(sorted(valid))}. "
            f"Received: model_kwargs={config['model_kwargs']!r}"
        )


def check_scaling(config, replicas=1):
    """The scaling rule must be defined at kappa = steps x replicas."""
    if config["scaling_rule"]:
        kappa = config["steps"] * replicas
        hyper = {k: config[k] for k in ("learning_rate", "beta_1", "beta_2", "epsilon")}
        try:
            ka.scale_hyperparameters(kappa, config["scaling_rule"], **hyper)
        except ValueError as e:
            raise cfg.ConfigError(f"scaling_rule={config['scaling_rule']!r}: {e}") from None


def _check_steps_schedule(config):
    """A schedule needs both lists, a valid PiecewiseSteps, `steps` = its
    largest value, and a scaling rule InvariantAdam can follow per window."""
    boundaries, values = config["steps_boundaries"], config["steps_values"]
    if boundaries is None and values is None:
        return
    received = f"Received: steps_boundaries={boundaries!r}, steps_values={values!r}"
    if boundaries is None or values is None:
        raise cfg.ConfigError(f"Give both `steps_boundaries` and `steps_values`. {received}")
    try:
        ka.PiecewiseSteps(boundaries, values)
    except ValueError as e:
        raise cfg.ConfigError(str(e)) from None
    if config["steps"] != max(values):
        raise cfg.ConfigError(
            f"`steps` must be the schedule's largest window {max(values)}. "
            f"Received: steps={config['steps']!r}"
        )
    rule = config["scaling_rule"]
    if rule and (rule == "sqrt" or config["optimizer"] != "invariant_adam"):
        raise cfg.ConfigError(
            "With a steps schedule only optimizer='invariant_adam' rescales per window, "
            "with scaling_rule 'invariant', 'power' or 'fixed_beta_1'. "
            f"Received: scaling_rule={rule!r}, "
            f"optimizer={config['optimizer']!r}"
        )
    if config["lr_schedule"] != "constant" and not rule:
        raise cfg.ConfigError(
            "A learning-rate schedule with a steps schedule needs a scaling_rule (it then "
            f"counts micro-batches). Received: lr_schedule={config['lr_schedule']!r}"
        )
    if config["strategy"] == "multi_worker":
        raise cfg.ConfigError(
            "The multi-worker loop (keras_accum.training.train) needs a constant `steps`. "
            + received
        )


def _check_data_dir(config):
    folder = config["data_dir"]
    if folder is not None and pathlib.Path(folder).exists() and not pathlib.Path(folder).is_dir():
        raise cfg.ConfigError(
            f"`data_dir` must be a folder (it is created if missing). Received: data_dir={folder!r}"
        )


def _check_tf_config(config):
    if config["strategy"] == "multi_worker":
        distribute.check_tf_config(os.environ.get("TF_CONFIG"))


SCHEMA = cfg.Schema(
    "run",
    FIELDS,
    [_check_model_kwargs, check_scaling, _check_steps_schedule, _check_data_dir, _check_tf_config],
)
DEFAULTS = SCHEMA.defaults()


def resolve_config(config):
    """DEFAULTS updated with `config`; every value checked (ConfigError)."""
    return SCHEMA.resolve(config)


def validation_examples(config, num_train_examples):
    """How many train examples `validation_split` holds out."""
    return int(round(config.get("validation_split", 0.0) * num_train_examples))


def resume_config(config, workdir):
    """The run folder's own config, checked against its checkpoints' copy.

    A folder without a checkpoint (killed before its first one) may lack
    config.json: its run's config is then `checkpoints/config.json`, the
    first file a new run writes (see `run_folder`)."""
    run_folder.check_path(workdir)
    path = workdir / "config.json"
    original_path = workdir / "checkpoints" / "config.json"
    started = run_folder.has_checkpoint(workdir)
    if not path.is_file():
        if started or not original_path.is_file():
            hint = f"; start a run there with --config <file> --workdir {workdir}"
            hint = "" if started else hint
            raise FileNotFoundError(
                f"--resume: no run folder at {str(workdir)!r} (config.json missing){hint}."
            )
        path = original_path
    try:
        saved = resolve_config(cfg.load_json(path))
    except cfg.ConfigError as error:
        if started:
            raise
        raise cfg.ConfigError(
            f"{error} No checkpoint there yet: the plain command (--config <file> "
            f"--workdir {workdir}) starts the run again."
        ) from None
    if started and original_path.is_file():
        # Resolved too: a key added since the run started takes its default.
        original = resolve_config(cfg.load_json(original_path))
        changed = SCHEMA.diff(saved, original)
        if changed:
            raise cfg.ConfigError(
                f"--resume: {str(path)!r} differs from the config its checkpoints were made "
                f"with in {', '.join(changed)}; restore it (copy of the original: "
                f"{str(original_path)!r}) or start a new run with --config {str(path)!r}."
            )
    if config is not None:
        changed = SCHEMA.diff(resolve_config(config), saved)
        if changed:
            raise cfg.ConfigError(
                f"--resume continues the folder's own config; the given one differs in "
                f"{', '.join(changed)}. Drop the other config or overrides."
            )
    return saved


def check_data(config, replicas):
    """(DatasetInfo, held-out examples, windows per epoch), or ConfigError."""
    info = data.dataset_info(config["dataset"], config["data_dir"])
    if config["model"] == "transformer" and info.vocab_size is None:
        raise cfg.ConfigError(
            f"model='transformer' needs a token dataset (synthetic_tokens). "
            f"Received: dataset={config['dataset']!r}"
        )
    if config["model"] == "resnet" and len(info.input_shape) != 3:
        raise cfg.ConfigError(
            f"model='resnet' needs images (height, width, channels); dataset "
            f"{config['dataset']!r} has inputs of shape {info.input_shape}."
        )
    held_out = validation_examples(config, info.num_train_examples)
    window_examples = config["micro_batch_size"] * replicas * config["steps"]
    windows_per_epoch = (info.num_train_examples - held_out) // window_examples
    if windows_per_epoch < 1:
        raise cfg.ConfigError(
            f"One window (micro_batch_size x steps x replicas = {window_examples}) is "
            f"larger than the training set ({info.num_train_examples - held_out} examples "
            f"after validation_split={config['validation_split']})."
        )
    if config["validation_split"] and held_out < 1:
        raise cfg.ConfigError(
            f"validation_split={config['validation_split']} holds out no example of "
            f"{info.num_train_examples}."
        )
    return info, held_out, windows_per_epoch


# A config from a saved_configs/*.py file (its `get_config(*args)`) or from a
# run folder's config.json (then `args` are ignored): for every script.
load_config_file = cfg.load_file
