"""Trains a model from a saved config and writes a self-contained run folder.

    python scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py
    python scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py \
        --steps 8 --scaling_rule invariant --workdir runs/k8
    python scripts/train.py --workdir runs/k8 --resume

Flags left unset keep the config's value. See keras_accum/experiments/experiment.py for
the config keys and what the run folder holds.
"""

import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import (
    app,  # noqa: E402
    flags,  # noqa: E402
    logging,  # noqa: E402
)

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "saved_configs/*.py file or run folder.")
flags.DEFINE_string("workdir", None, "Run folder (default runs/<config>-<time>).")
flags.DEFINE_bool("resume", False, "Continue the run in --workdir.")
# Overrides of config keys (unset = keep the config's value).
flags.DEFINE_enum(
    "optimizer",
    None,
    ["invariant_adam", "update_accumulation_adam", "gradient_accumulation"],
    "Which keras_accum optimizer.",
)
flags.DEFINE_integer("steps", None, "Micro-batches per update per replica.")
flags.DEFINE_integer("micro_batch_size", None, "Items per micro-batch.")
flags.DEFINE_float("learning_rate", None, "Learning rate at kappa = 1.")
flags.DEFINE_enum(
    "scaling_rule",
    None,
    ["invariant", "sqrt", "power", "none"],
    "Rescale lr/betas from kappa = 1 to steps x replicas.",
)
flags.DEFINE_enum(
    "lr_schedule", None, ["constant", "cosine"], "Learning-rate schedule over the updates."
)
flags.DEFINE_float("weight_decay", None, "Decoupled weight decay.")
flags.DEFINE_integer("epochs", None, "Epochs.")
flags.DEFINE_integer("seed", None, "Random seed.")
flags.DEFINE_enum(
    "strategy", None, ["default", "mirrored", "multi_worker"], "tf.distribute strategy."
)
flags.DEFINE_bool("mixed_precision", None, "mixed_float16 policy.")
flags.DEFINE_bool("jit_compile", None, "Compile the step with XLA.")
flags.DEFINE_string("dataset", None, "TFDS name (mnist1d is built offline).")
flags.DEFINE_string("data_dir", None, "TFDS data_dir for prepared datasets.")
flags.DEFINE_string("model", None, "Model name (mlp, cnn, resnet, transformer).")

OVERRIDES = [
    "optimizer",
    "steps",
    "micro_batch_size",
    "learning_rate",
    "scaling_rule",
    "lr_schedule",
    "weight_decay",
    "epochs",
    "seed",
    "strategy",
    "mixed_precision",
    "jit_compile",
    "dataset",
    "data_dir",
    "model",
]


def parse_flags(argv):
    try:
        return FLAGS(argv)
    except flags.Error as e:
        valid = sorted(["config", "workdir", "resume"] + OVERRIDES)
        sys.exit(f"{e}\nValid flags: --{', --'.join(valid)}")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # TFDS logs every dataset read
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    from keras_accum.experiments import experiment

    if FLAGS.resume:
        if not FLAGS.workdir:
            sys.exit("--resume needs --workdir (the run folder to continue).")
        overrides = [n for n in OVERRIDES if FLAGS[n].value is not None]
        if overrides or FLAGS.config:
            sys.exit(
                "--resume continues the folder's own config; drop "
                f"--config and overrides ({', '.join(overrides)})."
            )
        config = None
    else:
        if not FLAGS.config:
            sys.exit("--config is required (e.g. saved_configs/mnist1d_cnn_invariant.py).")
        config = experiment.load_config_file(FLAGS.config)
        for name in OVERRIDES:
            value = FLAGS[name].value
            if value is not None:
                config[name] = None if value == "none" else value
    workdir = FLAGS.workdir or os.path.join(
        "runs", f"{pathlib.Path(FLAGS.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    try:
        final = experiment.train_and_evaluate(config, workdir, resume=FLAGS.resume)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(
        f"\nResults in {workdir}/ (config.json, metrics.csv, curves.png, "
        "final.json, tensorboard/, checkpoints/)"
    )
    print(
        f"Final test accuracy: {final['test_accuracy']:.4f}  "
        f"test loss: {final['test_loss']:.4f}  "
        f"({final['updates']} updates, kappa={final['kappa']})"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
