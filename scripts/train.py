"""Trains a model from a saved config and writes a self-contained run folder.

    python scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py
    python scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py \
        --steps 8 --scaling_rule invariant --workdir runs/k8
    python scripts/train.py --workdir runs/k8 --resume

Every config key is also a flag (derived from the run's schema,
keras_accum/experiments/run_config.py); flags left unset keep the config's
value. The whole run is checked before anything is written: a bad value is
one line `error: ...` naming it and the accepted values, exit status 2
(flags) or 1 (config, data, run folder).
"""

import contextlib
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's BFC allocator on the CPU reports its peak: final.json records
# the run's peak tensor memory (the GPU's allocator always reports it).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags, logging  # noqa: E402

SCRIPT_FLAGS = ("config", "workdir", "resume")


def make_flags():
    """The script's flags: its own three and one per config key."""
    from keras_accum.experiments import experiment

    fv = flags.FlagValues()
    flags.DEFINE_string("config", None, "saved_configs/*.py file or run folder.", flag_values=fv)
    flags.DEFINE_string(
        "workdir", None, "Run folder (default runs/<config>-<time>).", flag_values=fv
    )
    flags.DEFINE_bool("resume", False, "Continue the run in --workdir.", flag_values=fv)
    experiment.SCHEMA.define_flags(fv)
    return fv


def usage(fv):
    return f"{__doc__}\nFlags:\n{fv.get_help(include_special_flags=False)}"


def parse(fv, argv):
    """Parses `argv`; a flags.Error says which flag and lists the valid ones."""
    try:
        rest = fv(argv)
    except flags.Error as e:
        valid = ", ".join("--" + name for name in sorted(fv))
        raise flags.Error(f"{e}. Valid flags: {valid}") from None
    if len(rest) > 1:
        raise flags.Error(f"Unexpected arguments {rest[1:]}; flags are --name=value.")


def run_config(fv):
    """The config to run (None with --resume: the folder's own)."""
    from keras_accum.experiments import experiment

    overrides = experiment.SCHEMA.flag_overrides(fv)
    if fv.resume:
        if not fv.workdir:
            raise ValueError("--resume needs --workdir (the run folder to continue).")
        if overrides or fv.config:
            given = ["--config"] * bool(fv.config) + ["--" + name for name in overrides]
            raise ValueError(
                f"--resume continues the folder's own config; drop {', '.join(given)}."
            )
        return None
    if not fv.config:
        raise ValueError("--config is required (e.g. saved_configs/mnist1d_cnn_invariant.py).")
    config = experiment.load_config_file(fv.config)
    config.update(overrides)
    return experiment.resolve_config(config)


def main(argv):
    """The script; returns its exit status (0 done, 1 refused run, 2 bad flags,
    3 a multi-worker peer was lost: resume with the command in the message)."""
    logging.set_verbosity(logging.WARNING)  # TFDS logs every dataset read
    fv = make_flags()
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv[1:]):
        print(usage(fv))
        return 0
    from keras_accum.experiments import experiment
    from keras_accum.training import WorkerLostError, distribute

    try:
        parse(fv, argv)
        config = run_config(fv)
        workdir = fv.workdir or os.path.join(
            "runs", f"{pathlib.Path(fv.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        # Multi-worker: a worker lost at any moment (also while the model is
        # built) is a WorkerLostError with the command that resumes.
        lost_peer = contextlib.nullcontext()
        if distribute.multi_worker_environment():
            lost_peer = distribute.peer_errors(
                f"python scripts/train.py --workdir {workdir} --resume"
            )
        with lost_peer:
            final = experiment.train_and_evaluate(config, workdir, resume=fv.resume)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except WorkerLostError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(
        f"\nResults in {workdir}/ (config.json, metrics.csv, curves.png, "
        "final.json, tensorboard/, checkpoints/)"
    )
    print(
        f"Final test accuracy: {final['test_accuracy']:.4f}  "
        f"test loss: {final['test_loss']:.4f}  "
        f"({final['updates']} updates, kappa={final['kappa']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
