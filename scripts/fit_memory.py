"""Does one micro-batch of a run fit a memory budget, with and without
remat, and which micro-batch and `steps` give the batch you want?

    python scripts/fit_memory.py --config saved_configs/mnist1d_cnn_invariant.py \\
        --budget_mb 512 --batch 256

For each remat mode, every number is the peak tensor memory of a measured
training step (a fresh process per micro-batch size tried, TensorFlow's BFC
allocator; weights, optimizer state, batch and activations all counted),
not a formula: whether micro-batch 1 fits, and the largest micro-batch
dividing --batch (tried 1, 2, 4, ..., --batch) that fits, with
steps = batch / micro-batch, on one device. Every run config key is also a
flag (--model_kwargs, --mixed_precision, --jit_compile, ...). How it
measures: keras_accum/experiments/fit_memory.py.
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402


def make_flags():
    from keras_accum.experiments import experiment

    fv = flags.FlagValues()
    flags.DEFINE_string("config", None, "saved_configs/*.py file or run folder.", flag_values=fv)
    flags.DEFINE_float("budget_mb", None, "Memory budget in MB.", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("batch", None, "Desired batch (items per update).", 1, flag_values=fv)
    flags.DEFINE_list("modes", ["none", "full"], "remat modes to try.", flag_values=fv)
    experiment.SCHEMA.define_flags(fv)
    return fv


def main(argv):
    from keras_accum import remat
    from keras_accum.experiments import experiment, fit_memory

    fv = make_flags()
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise flags.Error(f"Unexpected arguments {rest[1:]}; flags are --name=value.")
        for name in ("config", "budget_mb", "batch"):
            if fv[name].value is None:
                raise flags.Error(f"--{name} is required.")
        for mode in fv.modes:
            remat.check_mode(mode)
        config = experiment.load_config_file(fv.config)
        config.update(experiment.SCHEMA.flag_overrides(fv))
        config = experiment.resolve_config(config)
    except (flags.Error, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config.pop("remat")
    plan = fit_memory.plan(
        config,
        fv.budget_mb,
        fv.batch,
        modes=fv.modes,
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(f"\nBudget {fv.budget_mb:g} MB, batch {fv.batch} (model {config['model']}):")
    print("remat        micro-batch 1   fits  micro-batch  steps  peak MB")
    for mode, row in plan.items():
        best = row["micro_batch"]
        peak = f"{row['peak_mb']:.1f}" if best else "-"
        print(
            f"{mode:<12} {row['micro_batch_1_mb']:>10.1f} MB  {'yes' if row['fits'] else 'no':>4}"
            f"  {best or '-':>11}  {row['steps'] or '-':>5}  {peak:>7}"
        )
        if best:
            print(
                f"  python scripts/train.py --config {fv.config} --micro_batch_size {best} "
                f"--steps {row['steps']} --remat {mode}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
