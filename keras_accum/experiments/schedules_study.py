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
* **warmup** (`warmup_learning_rates`): per method (InvariantAdam with each
  of `warmup_rules`; sqrt, its rule re-applied at every switch) constant
  kappa = 1 (shared) and K, the doubling 1, 2, ..., K at
  `warmup_boundaries`, and AdaptiveSteps(1, K): updates to reach kappa = 1's
  final test loss (`schedules_report.warmup_summary`).

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
from keras_accum.experiments import config as cfg
from keras_accum.experiments import optimizers
from keras_accum.experiments.invariance.report import write_csv
from keras_accum.experiments.study_runner import (
    METRICS,
    StudyRunner,
    micro_batch_indices,
)
from keras_accum.training import atomic

F, _RATE = cfg.Field, cfg.POSITIVE
_METHODS = ("invariant", "power", "sqrt")
_SCHEDULES = ("kappa=1", "kappa=K", "piecewise", "adaptive")
_DECISION_KEYS = ("method", "seed", "learning_rate", "micro_step", "b_simple", "steps")


def _examples(name, default, help):
    return F(name, "int", default, help + " (a multiple of the largest window)", minimum=1)


FIELDS = [
    F("dataset", "str", "mnist1d", "TFDS name, or char_corpus (the character LM)"),
    F("data_dir", "path", None, "TFDS data_dir"),
    F("model", "str", "mlp", "Model name (ignored for char_corpus)"),
    F("micro_batch_size", "int", 32, "Items per micro-batch", minimum=1),
    cfg.fraction("beta_1", 0.9, "Adam beta_1 at kappa = 1"),
    cfg.fraction("beta_2", 0.999, "Adam beta_2 at kappa = 1"),
    F("epsilon", "float", 1e-7, "Adam epsilon", minimum=0.0, open_minimum=True),
    F("seeds", "list", [0, 1, 2], "Seeds", item=F("", "int", 0, "", minimum=0)),
    _examples("train_examples", 32768, "Examples per run"),
    _examples("eval_every", 1024, "Examples between evaluations"),
    F("train_eval_examples", "int", 1000, "Fixed train subset for the train loss", minimum=1),
    # switch experiment
    F("switch_kappa", "int", 8, "kappa after the switch", minimum=1),
    _examples("switch_examples", 16384, "Examples before the switch"),
    cfg.names("switch_methods", _METHODS, "Methods", _METHODS),
    F("switch_learning_rates", "list", [1e-4, 1e-3, 1e-2], "Base lrs", minimum=0, item=_RATE),
    # adaptive experiment
    F("adaptive_learning_rates", "list", [1e-3], "Base lrs", minimum=0, item=_RATE),
    F("adaptive_max_steps", "int", 16, "Largest window of AdaptiveSteps", minimum=1),
    _examples("probe_every", 1024, "Examples between B_simple probes"),
    F("probe_windows", "int", 4, "Probe windows per estimate", minimum=1),
    cfg.fraction("probe_ema", 0.9, "EMA of the B_simple estimates"),
    # AdaptiveSteps' keyword arguments in both experiments. The published
    # runs used the first rule (no smoothing of its own: the probes' EMA
    # smooths; a decision from the first estimate).
    F(
        "adaptive_kwargs",
        "dict",
        {"smoothing": 0.0, "min_observations": 1},
        "AdaptiveSteps smoothing, min_observations",
    ),
    # warmup experiment (off while warmup_learning_rates is empty)
    F("warmup_learning_rates", "list", [], "Base lrs", minimum=0, item=_RATE),
    F("warmup_kappa", "int", 8, "Largest kappa K (a power of two)", minimum=1),
    cfg.names(
        "warmup_rules", ["fixed_beta_1"], "InvariantAdam rules", ka.scaling.SCALING_RULES[:-1]
    ),
    cfg.names("warmup_schedules", list(_SCHEDULES), "Runs (with sqrt too)", _SCHEDULES),
    F("warmup_boundaries", "list", [64, 192, 448], "Micro-steps where kappa doubles", minimum=0),
    F("verbose", "int", 1, "1: a line per run, 0: silent", choices=(0, 1)),
]


def _check_windows(c):
    kappas = [c["switch_kappa"], c["adaptive_max_steps"]]
    window = max(kappas + [c["warmup_kappa"]] * bool(c["warmup_learning_rates"]))
    window *= c["micro_batch_size"]
    for key in ("eval_every", "switch_examples", "train_examples", "probe_every"):
        if c[key] % window:
            raise cfg.ConfigError(
                f"`{key}` must be a positive multiple of the largest window "
                f"({window} examples). Received: {key}={c[key]!r}"
            )


def _check_warmup(c):
    k, bounds, b = c["warmup_kappa"], c["warmup_boundaries"], c["micro_batch_size"]
    if k & (k - 1) and c["warmup_learning_rates"]:
        raise cfg.ConfigError(f"`warmup_kappa` must be a power of two. Received: warmup_kappa={k}")
    n, chunk, total = k.bit_length() - 1, c["eval_every"] // b, c["train_examples"] // b
    ok = len(bounds) == n and bounds == sorted(set(bounds)) and bounds[-1:] < [total]
    if c["warmup_learning_rates"] and not (ok and all(m > 0 and m % chunk == 0 for m in bounds)):
        raise cfg.ConfigError(
            f"`warmup_boundaries` must be log2(warmup_kappa) = {n} increasing multiples of "
            f"{chunk} micro-steps (eval_every / micro_batch_size) below {total} (train_examples"
            f" / micro_batch_size). Received: warmup_boundaries={bounds!r}"
        )


def _check_adaptive(c):
    try:
        ka.AdaptiveSteps(1, 2, c["micro_batch_size"], **c["adaptive_kwargs"])
    except (TypeError, ValueError) as e:
        message = str(e).splitlines()[0]
        raise cfg.ConfigError(f"adaptive_kwargs={c['adaptive_kwargs']!r}: {message}") from None


SCHEMA = cfg.Schema("schedules study", FIELDS, [_check_windows, _check_warmup, _check_adaptive])
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
    if method != "sqrt":
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
        self.trainer, self.x_train, self.y_train = StudyRunner.for_config(c)
        self.rows, self.decisions, self.warmup_decisions = [], [], []

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
            for lr in c["warmup_learning_rates"]:
                self._warmup_runs(seed, lr, weights, stream)

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

    def _switch_runs(self, seed, lr, weights, stream, warmup=False):
        """kappa = 1, kappa = K and a piecewise schedule per method: the
        switch 1 -> switch_kappa, or (`warmup`) the doubling 1, 2, ..., K at
        `warmup_boundaries` with the kappa = 1 run shared (Adam for all).
        `sqrt` re-applies its rule at every switch: a phase per segment."""
        c = self.config
        b = c["micro_batch_size"]
        total, chunk = c["train_examples"] // b, c["eval_every"] // b
        if warmup:
            k, bounds = c["warmup_kappa"], c["warmup_boundaries"]
            kappas = [2**i for i in range(len(bounds) + 1)]
            methods, names = c["warmup_rules"] + ["sqrt"], ("kappa=1", "kappa=K", "piecewise")
        else:
            k, bounds = c["switch_kappa"], [c["switch_examples"] // b]
            kappas, methods, names = [1, k], c["switch_methods"], ("kappa=1", "kappa=K", "switch")
        experiment, ones = ("warmup" if warmup else "switch"), None
        for method in methods:
            sqrt = method == "sqrt"
            for name, steps in zip(names, (1, k, ka.PiecewiseSteps(bounds, kappas))):
                run = f"kappa={k}" if name == "kappa=K" else name
                if warmup and name not in c["warmup_schedules"]:
                    continue
                if steps == 1 and ones and (method == "power" or warmup):
                    self._record(experiment, method, run, lr, seed, ones)
                    continue  # power is invariant at kappa = 1
                phases, segments = (), [(total, 0, lr)]
                if sqrt and steps == k:
                    segments = [(total, 0, _sqrt_learning_rate(lr, k))]
                if sqrt and name == names[2]:  # else the schedule alone switches
                    edges = enumerate(zip([0] + bounds, bounds + [total], kappas))
                    segments = [(e - s, i, _sqrt_learning_rate(lr, v)) for i, (s, e, v) in edges]
                    phases = [functools.partial(_apply_sqrt_rule, kappa=v, c=c) for v in kappas]
                    phases = tuple(phases[1:])
                make = functools.partial(method_optimizer, method, steps, c)
                points = self.trainer.run_segments(
                    (experiment, method, run), make, segments, weights, *stream, chunk, phases
                )
                self._record(experiment, method, run, lr, seed, points)
                if steps == 1 and (warmup or not sqrt):
                    ones = points

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

    def _warmup_runs(self, seed, lr, weights, stream):
        """The warmup's constant and piecewise runs (`_switch_runs`), then
        AdaptiveSteps(1, K) per method, probed at every evaluation."""
        c = self.config
        self._switch_runs(seed, lr, weights, stream, warmup=True)
        if "adaptive" not in c["warmup_schedules"]:
            return
        b, k = c["micro_batch_size"], c["warmup_kappa"]
        total, chunk = c["train_examples"] // b, c["eval_every"] // b
        for method in c["warmup_rules"] + ["sqrt"]:
            key = ("warmup", method, "adaptive")
            self.trainer.forget(key)  # A schedule object is per optimizer.
            # Sizes 1, 2, 4, ..., K: every window ends at a chunk's end.
            steps = _adaptive_steps(c, k, powers_of_two=True)
            make = functools.partial(method_optimizer, method, steps, c)
            if method == "sqrt":  # variables: the one trace follows the rule
                make = functools.partial(_variable_hyperparameters, make)
            probe = self._warmup_probe(seed, lr, method)
            points = self.trainer.run_segments(
                key, make, [(total, 0, lr)], weights, *stream, chunk, probe=probe
            )
            self._record("warmup", method, "adaptive", lr, seed, points)

    def _warmup_probe(self, seed, lr, method):
        """`_prober` for a schedule built with `powers_of_two` (every window
        divides K and the chunks: a change takes effect with the next
        window, at a chunk start); logs the decisions; for sqrt re-applies
        the rule when the size changes."""
        probe = self._prober(seed)

        def warmup_probe(optimizer):
            before, b_simple = int(optimizer.steps.steps), probe(optimizer)
            after, step = int(optimizer.steps.steps), int(optimizer.micro_step)
            assert int(optimizer._window.end) == step, "a window straddles the chunk end"
            if method == "sqrt" and after != before:
                _apply_sqrt_rule(optimizer, after, self.config)
                optimizer.learning_rate = _sqrt_learning_rate(lr, after)
            record = (method, seed, lr, step, b_simple, after)
            self.warmup_decisions.append(dict(zip(_DECISION_KEYS, record)))

        return warmup_probe

    def _prober(self, seed):
        """Every call: B_simple from `probe_windows` windows of 8 seeded
        training micro-batches at the current weights, smoothed over calls;
        fed to the optimizer's AdaptiveSteps; returns the value fed."""
        c = self.config
        b, kappa = c["micro_batch_size"], 8
        tracker, window = self.trainer.fresh_noise_probe(b, kappa, c["probe_ema"])
        rng = np.random.default_rng([seed, 3])

        def probe(optimizer):
            for _ in range(c["probe_windows"]):
                idx = rng.choice(len(self.x_train), kappa * b, replace=False).reshape(kappa, b)
                window(tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            value = float(tracker.b_simple)
            optimizer.steps.observe(value)
            return value

        return probe

    def write(self, workdir):
        from keras_accum.experiments import schedules_report

        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        atomic.atomic_write_text(workdir / "config.json", json.dumps(self.config, indent=2) + "\n")
        write_csv(workdir / "runs.csv", self.rows)
        if self.decisions:  # none without adaptive runs
            write_csv(workdir / "decisions.csv", self.decisions)
        if self.warmup_decisions:
            write_csv(workdir / "warmup_decisions.csv", self.warmup_decisions)
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


def _adaptive_steps(c, top, **fixed):
    """The study's `AdaptiveSteps` from 1 to `top` micro-batches (`fixed`
    keyword arguments over the config's)."""
    return ka.AdaptiveSteps(1, top, c["micro_batch_size"], **{**c["adaptive_kwargs"], **fixed})


def _apply_sqrt_rule(optimizer, kappa, c):
    """The square-root rule for `kappa` (from the config's kappa = 1 values)
    set on the inner Adam, or assigned (`_variable_hyperparameters`)."""
    inner = optimizer.inner_optimizer
    h = ka.scale_hyperparameters(kappa, "sqrt", 1.0, c["beta_1"], c["beta_2"], c["epsilon"])
    for name in ("beta_1", "beta_2", "epsilon"):
        if isinstance(getattr(inner, name), tf.Variable):
            getattr(inner, name).assign(h[name])
        else:
            setattr(inner, name, h[name])


def _variable_hyperparameters(make):
    """`make()` with its inner Adam's betas and epsilon variables: one trace
    follows their changes."""
    optimizer = make()
    inner = optimizer.inner_optimizer
    for name in ("beta_1", "beta_2", "epsilon"):
        setattr(inner, name, tf.Variable(getattr(inner, name), trainable=False, dtype="float32"))
    return optimizer


def run_study(config, workdir):
    study = SchedulesStudy(config)
    study.run()
    study.write(workdir)
    return study


__all__ = ["DEFAULTS", "METRICS", "SchedulesStudy", "resolve_config", "run_study"]
