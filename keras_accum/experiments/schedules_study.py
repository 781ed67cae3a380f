"""Batch-size schedules study: changing kappa during a run (docs/BATCH_SIZE_SCHEDULES.md).

Two experiments on MNIST-1D (or, with `dataset="char_corpus"`, on the
character-level transformer LM of `keras_accum.experiments.charlm`; `model`
is then ignored), every run of a seed from the same weights and the same
stream of micro-batches (only their grouping into updates changes):

* **switch**: kappa = 1 for the first `switch_examples`, then 8. Per base
  learning rate (tuned at kappa = 1) and method, three runs: constant
  kappa = 1, constant kappa = 8, and the switch.

  | method      | optimizer                                                  |
  |-------------|------------------------------------------------------------|
  | `invariant` | `InvariantAdam(lr, steps=..., scaling_rule="invariant")`   |
  | `power`     | `InvariantAdam(lr, steps=..., scaling_rule="power")`       |
  | `sqrt`      | `GradientAccumulation(Adam(...), steps=...)`, square-root rule |

  The `sqrt` switch re-applies the rule at the switch (lr x sqrt 8,
  1 - beta x 8, eps / sqrt 8) to the same Adam, its moments kept.

  At kappa = 1 `power` is `invariant`: that run is shared. The spread at a
  point is max - min over the runs compared; `ratio` = mean spread of
  {kappa=1, kappa=8, switch} / mean spread of {kappa=1, kappa=8} over the
  points after the switch (<= 2: the switch stays on the constant curves),
  `offset` = mean |switch - kappa=1| there.
* **adaptive**: `InvariantAdam(scaling_rule="power")` under
  `AdaptiveSteps(1, max_steps, micro_batch_size)`, fed every
  `probe_every` examples a B_simple estimate (a `GradientNoiseScale` over
  `probe_windows` probe windows of 8 training micro-batches, drawn with a
  seeded generator), against constant kappa = 1 and kappa = max_steps:
  final losses at equal examples and number of updates.

Speed: one compiled loop per optimizer configuration, reused over seeds and
learning rates by restoring the optimizer's initial variable values.
"""

import functools
import json
import pathlib
import time

import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum import diagnostics
from keras_accum.experiments import charlm, data, optimizers
from keras_accum.experiments import config as cfg
from keras_accum.experiments.invariance.report import write_csv
from keras_accum.experiments.study_runner import (
    METRICS,
    StudyRunner,
    load_arrays,
    micro_batch_indices,
)
from keras_accum.training import atomic

F = cfg.Field
_POSITIVE = F("", "float", 1e-3, "", minimum=0.0, open_minimum=True)
_METHODS = ("invariant", "power", "sqrt")


def _fraction(name, default, help):
    return F(name, "float", default, help, minimum=0.0, maximum=1.0, open_maximum=True)


def _examples(name, default, help):
    return F(name, "int", default, help + " (a multiple of the largest window)", minimum=1)


FIELDS = [
    F("dataset", "str", "mnist1d", "TFDS name, or char_corpus (the character LM)"),
    F("data_dir", "path", None, "TFDS data_dir"),
    F("model", "str", "mlp", "Model name (ignored for char_corpus)"),
    F("micro_batch_size", "int", 32, "Items per micro-batch", minimum=1),
    _fraction("beta_1", 0.9, "Adam beta_1 at kappa = 1"),
    _fraction("beta_2", 0.999, "Adam beta_2 at kappa = 1"),
    F("epsilon", "float", 1e-7, "Adam epsilon", minimum=0.0, open_minimum=True),
    F("seeds", "list", [0, 1, 2], "Seeds", item=F("", "int", 0, "", minimum=0)),
    _examples("train_examples", 32768, "Examples per run"),
    _examples("eval_every", 1024, "Examples between evaluations"),
    F("train_eval_examples", "int", 1000, "Fixed train subset for the train loss", minimum=1),
    # switch experiment
    F("switch_kappa", "int", 8, "kappa after the switch", minimum=1),
    _examples("switch_examples", 16384, "Examples before the switch"),
    F(
        "switch_methods",
        "list",
        list(_METHODS),
        "Methods",
        item=F("", "str", "", "", choices=_METHODS),
    ),
    F("switch_learning_rates", "list", [1e-4, 1e-3, 1e-2], "Base lrs", minimum=0, item=_POSITIVE),
    # adaptive experiment
    F("adaptive_learning_rates", "list", [1e-3], "Base lrs", minimum=0, item=_POSITIVE),
    F("adaptive_max_steps", "int", 16, "Largest window of AdaptiveSteps", minimum=1),
    _examples("probe_every", 1024, "Examples between B_simple probes"),
    F("probe_windows", "int", 4, "Probe windows per estimate", minimum=1),
    _fraction("probe_ema", 0.9, "EMA of the B_simple estimates"),
    # AdaptiveSteps' own smoothing and settling: off by default, the probes'
    # EMA already smooths (the published study ran without them).
    F("adaptive_smoothing", "float", 0.0, "AdaptiveSteps smoothing", minimum=0.0, maximum=0.99),
    F("adaptive_min_observations", "int", 1, "AdaptiveSteps min_observations", minimum=1),
    F("verbose", "int", 1, "1: a line per run, 0: silent", choices=(0, 1)),
]


def _check_windows(c):
    window = max(c["switch_kappa"], c["adaptive_max_steps"]) * c["micro_batch_size"]
    for key in ("eval_every", "switch_examples", "train_examples", "probe_every"):
        if c[key] % window:
            raise cfg.ConfigError(
                f"`{key}` must be a positive multiple of the largest window "
                f"({window} examples). Received: {key}={c[key]!r}"
            )


SCHEMA = cfg.Schema("schedules study", FIELDS, [_check_windows])
DEFAULTS = SCHEMA.defaults()


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values
    (`keras_accum.experiments.config.ConfigError`, a ValueError)."""
    return SCHEMA.resolve(config)


# -- optimizers ---------------------------------------------------------------


def method_optimizer(method, steps, c):
    """The optimizer of `method` with `steps` (int or schedule), lr 1e-3
    (set per run); `sqrt` is built with the kappa = steps hyperparameters
    when `steps` is an int, the kappa = 1 ones for a schedule."""
    base = {"learning_rate": 1e-3, "beta_1": c["beta_1"], "beta_2": c["beta_2"]}
    base["epsilon"] = c["epsilon"]
    if method in ("invariant", "power"):
        return optimizers.build("invariant_adam", steps, base, scaling_rule=method)
    kappa = steps if isinstance(steps, int) else 1
    h = ka.scale_hyperparameters(kappa, "sqrt", **base)
    return optimizers.build("gradient_accumulation", steps, h)


def _sqrt_learning_rate(lr, kappa):
    return ka.scale_hyperparameters(kappa, "sqrt", lr)["learning_rate"]


# -- the study ----------------------------------------------------------------


class SchedulesStudy:
    def __init__(self, config):
        self.config = c = resolve_config(config)
        self.started, self.cpu_started = time.time(), time.process_time()
        if c["dataset"] == charlm.CharCorpus.name:
            self.x_train, self.y_train = charlm.load_arrays("train", c["data_dir"])
            test = charlm.load_arrays("test", c["data_dir"])
            shape, classes, build = (charlm.SEQ_LEN,), charlm.VOCAB_SIZE, charlm.build_lm
        else:
            info = data.dataset_info(c["dataset"], c["data_dir"])
            self.x_train, self.y_train = load_arrays(c["dataset"], "train", c["data_dir"])
            test = load_arrays(c["dataset"], "test", c["data_dir"])
            shape, classes, build = info.input_shape, info.num_classes, None
        n = c["train_eval_examples"]
        self.trainer = StudyRunner(
            c["model"],
            shape,
            classes,
            {"train": (self.x_train[:n], self.y_train[:n]), "test": test},
            build=build,
        )
        self.rows, self.decisions = [], []

    def _log(self, message):
        if self.config["verbose"]:
            elapsed = (time.time() - self.started) / 60
            print(f"[{elapsed:5.1f} min] {message}", flush=True)

    def run(self):
        c = self.config
        b = c["micro_batch_size"]
        for seed in c["seeds"]:
            weights = self.trainer.initial_weights(seed)
            idx = micro_batch_indices(len(self.x_train), b, c["train_examples"] // b, seed)
            stream = (tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            for lr in c["switch_learning_rates"]:
                self._switch_runs(seed, lr, weights, stream)
            for lr in c["adaptive_learning_rates"]:
                self._adaptive_runs(seed, lr, weights, stream)

    def _record(self, experiment, method, run, lr, seed, points):
        for p in points:
            self.rows.append(
                {
                    "experiment": experiment,
                    "method": method,
                    "run": run,
                    "learning_rate": lr,
                    "seed": seed,
                    **p,
                }
            )
        end = points[-1]
        self._log(
            f"seed {seed} lr {lr:g} {experiment} {method} {run}: train loss "
            f"{end['train_loss']:.4f} test loss {end['test_loss']:.4f} "
            f"updates {end['updates']}"
        )

    def _switch_runs(self, seed, lr, weights, stream):
        c = self.config
        b, kappa = c["micro_batch_size"], c["switch_kappa"]
        total, switch = c["train_examples"] // b, c["switch_examples"] // b
        chunk = c["eval_every"] // b
        for method in c["switch_methods"]:
            sqrt = method == "sqrt"
            for run, steps in (
                ("kappa=1", 1),
                (f"kappa={kappa}", kappa),
                ("switch", ka.PiecewiseSteps([switch], [1, kappa])),
            ):
                if method == "power" and steps == 1:
                    continue  # identical to invariant at kappa = 1
                phases, segments = (), [(total, 0, lr)]
                if sqrt and steps == kappa:
                    segments = [(total, 0, _sqrt_learning_rate(lr, kappa))]
                if run == "switch":
                    segments = [(switch, 0, lr), (total - switch, 1, lr)]
                    if sqrt:
                        phases = (functools.partial(_apply_sqrt_rule, kappa=kappa),)
                        segments[1] = (total - switch, 1, _sqrt_learning_rate(lr, kappa))
                    else:  # the schedule alone switches; one loop
                        segments = [(total, 0, lr)]
                key = ("switch", method, run)
                make = functools.partial(method_optimizer, method, steps, c)
                points = self.trainer.run_segments(
                    key, make, segments, weights, *stream, chunk, phases
                )
                self._record("switch", method, run, lr, seed, points)
                if method == "invariant" and steps == 1 and "power" in c["switch_methods"]:
                    self._record("switch", "power", run, lr, seed, points)

    def _adaptive_runs(self, seed, lr, weights, stream):
        c = self.config
        b, top = c["micro_batch_size"], c["adaptive_max_steps"]
        total, chunk = c["train_examples"] // b, c["probe_every"] // b
        for run, steps in (
            ("kappa=1", 1),
            (f"kappa={top}", top),
            ("adaptive", _adaptive_steps(c, top)),
        ):
            probe = None
            if run == "adaptive":
                # A schedule object is per optimizer: rebuild for each run.
                self.trainer.forget(("adaptive", run))
                probe = self._prober(seed)
            make = functools.partial(method_optimizer, "power", steps, c)
            points = self.trainer.run_segments(
                ("adaptive", run), make, [(total, 0, lr)], weights, *stream, chunk, probe=probe
            )
            self._record("adaptive", "power", run, lr, seed, points)
            if run == "adaptive":
                opt = self.trainer.loops(("adaptive", run), make)[0]
                for decision in opt.steps.decisions:  # adaptive_steps.Decision records
                    self.decisions.append({"seed": seed, "learning_rate": lr, **decision._asdict()})

    def _prober(self, seed):
        """Every call: B_simple from `probe_windows` windows of 8 seeded
        training micro-batches at the current weights, smoothed over calls;
        fed to the optimizer's AdaptiveSteps."""
        c, trainer = self.config, self.trainer
        b, kappa = c["micro_batch_size"], 8
        tracker = diagnostics.GradientNoiseScale(c["probe_ema"])
        rng = np.random.default_rng([seed, 3])

        @tf.function(autograph=False)
        def window(xw, yw):
            micro = [trainer.gradient(xw[j], yw[j]) for j in range(kappa)]
            tracker.update_from_micro_grads(micro, b)

        def probe(optimizer):
            for _ in range(c["probe_windows"]):
                idx = rng.choice(len(self.x_train), kappa * b, replace=False).reshape(kappa, b)
                window(tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            optimizer.steps.observe(tracker.b_simple)

        return probe

    def write(self, workdir):
        from keras_accum.experiments import schedules_report

        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        atomic.atomic_write_text(workdir / "config.json", json.dumps(self.config, indent=2) + "\n")
        write_csv(workdir / "runs.csv", self.rows)
        if self.decisions:  # none without adaptive runs
            write_csv(workdir / "decisions.csv", self.decisions)
        seconds = time.time() - self.started
        cpu = time.process_time() - self.cpu_started
        schedules_report.write_report(self.rows, self.decisions, self.config, workdir)
        summary = {
            "rows": len(self.rows),
            "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1),
        }
        # Last: a folder without summary.json is an unfinished study.
        atomic.atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")


def _adaptive_steps(c, top, warmup=None):
    """The study's `AdaptiveSteps` from 1 to `top` micro-batches."""
    return ka.AdaptiveSteps(
        1,
        top,
        c["micro_batch_size"],
        smoothing=c["adaptive_smoothing"],
        min_observations=c["adaptive_min_observations"],
        warmup=warmup,
    )


def _apply_sqrt_rule(optimizer, kappa):
    """The square-root rule re-applied to the inner Adam at the switch."""
    inner = optimizer.inner_optimizer
    h = ka.scale_hyperparameters(kappa, "sqrt", 1.0, inner.beta_1, inner.beta_2, inner.epsilon)
    inner.beta_1, inner.beta_2, inner.epsilon = h["beta_1"], h["beta_2"], h["epsilon"]


def run_study(config, workdir):
    study = SchedulesStudy(config)
    study.run()
    study.write(workdir)
    return study


__all__ = ["DEFAULTS", "METRICS", "SchedulesStudy", "resolve_config", "run_study"]
