"""Runs the study and writes its output folder."""

import fnmatch
import json
import pathlib
import time

import tensorflow as tf

from keras_accum.experiments import run_folder
from keras_accum.experiments.invariance import report
from keras_accum.experiments.invariance.config import (
    method_optimizer,
    optimizer_hyperparameters,
    resolve_config,
)
from keras_accum.experiments.study_runner import StudyRunner, micro_batch_indices
from keras_accum.training import atomic

# The files a study writes; summary.json comes last, so a folder without it
# holds an unfinished study (killed, or stopped by an error).
OUTPUTS = (
    "config.json",
    "runs.csv",
    "noise_scale.csv",
    "spread.md",
    "spread_vs_lr.png",
    "frontier.png",
)


def _log(config, message):
    if config["verbose"]:
        print(message, flush=True)


def run_method(
    runner, method, kappa, base_lr, weights, xs, ys, chunk, betas=(0.9, 0.999, 1e-7), probe=None
):
    """One run of `method` with kappa micro-batches per update, from the base
    (kappa = 1) learning rate `base_lr` and `betas` = (beta_1, beta_2,
    epsilon), on `runner` (a `StudyRunner`): see `StudyRunner.run_segments`
    (`probe(optimizer)` runs after each chunk).

    The betas and epsilon a method uses depend on (method, kappa) only, so
    the compiled loop of a (method, kappa) serves every base learning rate.
    """
    h = optimizer_hyperparameters(method, kappa, base_lr, *betas)
    built = optimizer_hyperparameters(method, kappa, 1e-3, *betas)
    fixed = {k: v for k, v in h.items() if k != "learning_rate"}
    built_with = {k: v for k, v in built.items() if k != "learning_rate"}
    if fixed != built_with:  # Betas compiled in must not depend on lr.
        raise ValueError(
            f"{method} at kappa={kappa}: {fixed} differ from the compiled {built_with}."
        )
    make = lambda: method_optimizer(method, kappa, 1e-3, *betas)
    segments = [(int(xs.shape[0]), 0, h["learning_rate"])]
    key = (method, kappa, betas)
    return runner.run_segments(key, make, segments, weights, xs, ys, chunk, probe=probe)


class InvarianceStudy:
    """One study: the data, the shared `StudyRunner`, and the rows it records."""

    def __init__(self, config):
        self.config = config
        self.started, self.cpu_started = time.time(), time.process_time()
        self.trainer, self.x_train, self.y_train = StudyRunner.for_config(config)
        self.rows, self.noise_rows, self.done = [], [], 0
        share, methods = config["share_kappa1"], config["methods"]
        per_seed = len(config["learning_rates"]) * sum(
            1 if (k == 1 and share) else len(methods) for k in config["kappas"]
        )
        self.total = per_seed * len(config["seeds"])

    def run(self):
        c = self.config
        b = c["micro_batch_size"]
        _log(
            c,
            f"{self.total} runs of {c['train_examples']} examples "
            f"({c['train_examples'] // b} micro-batches of {b}); {len(c['seeds'])} seeds "
            f"x {len(c['learning_rates'])} learning rates x kappa {c['kappas']} "
            f"x {c['methods']}",
        )
        for seed in c["seeds"]:
            self._run_seed(seed)

    def _noise_row(self, seed, model, learning_rate):
        c = self.config
        estimate = self.trainer.noise_scale(
            self.x_train,
            self.y_train,
            c["micro_batch_size"],
            c["noise_scale_kappa"],
            c["noise_scale_windows"],
            seed=seed,
            ema=c["noise_scale_ema"],
        )
        self.noise_rows.append(
            {"seed": seed, "model": model, "learning_rate": learning_rate, **estimate}
        )

    def _run_seed(self, seed):
        c, trainer = self.config, self.trainer
        b = c["micro_batch_size"]
        weights = trainer.initial_weights(seed)
        idx = micro_batch_indices(len(self.x_train), b, c["train_examples"] // b, seed)
        stream = (tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
        for variable, value in zip(trainer.model.weights, weights):
            variable.assign(value)
        self._noise_row(seed, "initial", "")
        for lr in c["learning_rates"]:
            for kappa in c["kappas"]:
                # At kappa = 1 every method is Adam: run it once, record it
                # under each method.
                shared = kappa == 1 and c["share_kappa1"]
                for method in c["methods"][:1] if shared else c["methods"]:
                    self._run_one(seed, lr, kappa, method, shared, weights, stream)
                    if kappa == 1 and method == c["methods"][0]:
                        self._noise_row(seed, "trained, kappa=1", lr)

    def _run_one(self, seed, lr, kappa, method, shared, weights, stream):
        c = self.config
        t = time.time()
        chunk = c["eval_every"] // c["micro_batch_size"]
        betas = c["beta_1"], c["beta_2"], c["epsilon"]
        points = run_method(self.trainer, method, kappa, lr, weights, *stream, chunk, betas)
        self.done += 1
        h = optimizer_hyperparameters(method, kappa, lr, *betas)
        for as_method in c["methods"] if shared else [method]:
            for p in points:
                self.rows.append(
                    {
                        "method": as_method,
                        "learning_rate": lr,
                        "kappa": kappa,
                        "seed": seed,
                        **p,
                        "ran_as": method,
                        "optimizer_learning_rate": h["learning_rate"],
                        "beta_1": h["beta_1"],
                        "beta_2": h["beta_2"],
                        "epsilon": h["epsilon"],
                    }
                )
        elapsed, end = time.time() - self.started, points[-1]
        eta = elapsed / self.done * (self.total - self.done) / 60
        _log(
            c,
            f"[{self.done:4d}/{self.total}] seed {seed} lr {lr:g} kappa "
            f"{kappa} {'all (Adam)' if shared else method}"
            f": train loss {end['train_loss']:.4f} test acc "
            f"{end['test_accuracy']:.3f} ({time.time() - t:.1f}s;"
            f" elapsed {elapsed / 60:.1f} min, eta {eta:.1f} min)",
        )

    def write(self, workdir):
        c = self.config
        report.write_csv(workdir / "runs.csv", self.rows)
        report.write_csv(workdir / "noise_scale.csv", self.noise_rows)
        train_seconds = time.time() - self.started
        cpu_seconds = time.process_time() - self.cpu_started
        summary_rows = report.summarize(self.rows, c)
        atomic.atomic_write_text(
            workdir / "spread.md",
            report.markdown_report(
                summary_rows, self.noise_rows, c, train_seconds, cpu_seconds, self.rows
            ),
        )
        report.plot_spread(summary_rows, c, workdir / "spread_vs_lr.png")
        report.plot_frontier(self.rows, c, workdir / "frontier.png")
        for lr in c["plot_learning_rates"]:
            report.plot_method_curves(self.rows, c, lr, workdir / f"curves_lr_{lr:g}.png")
        return {
            "runs": self.done,
            "rows": len(self.rows),
            "seconds": round(time.time() - self.started, 1),
            "seconds_training": round(train_seconds, 1),
            "cpu_seconds_training": round(cpu_seconds, 1),
        }


def run_study(config, workdir):
    """Runs the study of `config` and writes the output folder `workdir`
    (see the module docstring). Returns the summary dict."""
    config = resolve_config(config)
    workdir = pathlib.Path(workdir)
    unfinished = _check_workdir(workdir)
    for path in unfinished:
        path.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    atomic.atomic_write_text(workdir / "config.json", json.dumps(config, indent=2, sort_keys=True))
    study = InvarianceStudy(config)
    study.run()
    summary = study.write(workdir)
    atomic.atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2))
    _log(
        config,
        f"Done in {summary['seconds'] / 60:.1f} min: {workdir}/ "
        "(runs.csv, spread.md, spread_vs_lr.png, curves_lr_*.png, "
        "noise_scale.csv, config.json)",
    )
    return summary


def _check_workdir(workdir):
    """The files of an unfinished study in `workdir` (to delete: it restarts
    there), or [] for a new or empty folder; refuses (one line) a file, a
    finished study and a folder with other files."""
    run_folder.check_path(workdir)
    found = list(workdir.iterdir()) if workdir.exists() else []
    ours = all(p.is_file() and _is_output(p.name) for p in found)
    if not ours:
        raise FileExistsError(f"workdir={str(workdir)!r} is not empty; choose a new folder.")
    return found


def _is_output(name):
    return name in OUTPUTS or fnmatch.fnmatch(name, "curves_lr_*.png") or atomic.is_partial(name)
