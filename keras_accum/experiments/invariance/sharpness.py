"""Preconditioned sharpness along the invariance study's runs: does Adam's
stability threshold predict where each scaling rule's invariance breaks?

`keras_accum.sharpness` has the measure (S = lambda_max(P^-1 H) by power
iteration, P from Adam's v) and the threshold (2 + 2 beta_1) /
(lr (1 - beta_1)). `InvariantAdam`'s v (so P) does not depend on kappa, so S
measured along the kappa = 1 run can be set against the threshold of each
rule's kappa = 8 hyperparameters: a rule should break at kappa = 8 where
S x lr > lr x threshold_rule,8, lr the base rate (a constant per rule).
Measured along an InvariantAdam run at kappa = 8 instead, S x lr shows
whether that run sits at its own threshold (self-stabilisation at the edge
of stability). H is of the train loss on the study's fixed train batch.
"""

import keras
import tensorflow as tf

import keras_accum as ka
from keras_accum import sharpness
from keras_accum.experiments.invariance import report
from keras_accum.experiments.invariance.study import run_method
from keras_accum.experiments.study_runner import StudyRunner, micro_batch_indices

RULES = ("invariant", "power", "fixed_beta_1")


class SharpnessProbe:
    """`probe(optimizer)` for `StudyRunner.run_segments`: records S and
    lambda_max(H) of `model` on (x, y) with P from Adam's (or InvariantAdam's)
    velocities; `rows` gets a dict per call."""

    def __init__(self, model, x, y, iterations, epsilon):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = model.trainable_variables
        x, y = tf.constant(x), tf.constant(y)
        self._top = tf.function(
            lambda scale: sharpness.preconditioned_sharpness(
                lambda: loss(y, model(x, training=False)), variables, scale, iterations
            )
        )
        self.epsilon, self.rows, self._ones = epsilon, [], [tf.ones_like(v) for v in variables]

    def __call__(self, optimizer):
        scale = sharpness.adam_preconditioner(optimizer, self.epsilon)
        self.rows.append(
            {
                "updates": int(optimizer.iterations.numpy()),
                "hessian_top": float(self._top(self._ones)),
                "sharpness": float(self._top(scale)),
            }
        )


def measure(config, learning_rates, seed=0, points=8, iterations=30, method="invariant", kappa=1):
    """Trains the run of `method` at `kappa` (default: the kappa = 1 run,
    Adam) of `config` (an invariance study config) at each base lr and
    probes it `points` times, evenly in examples. `method` must keep its v
    in `_velocities` (Adam, InvariantAdam). Returns a row per probe: lr,
    examples, train_loss, hessian_top, sharpness (S), sharpness_x_lr (S x
    the base lr)."""
    runner, x, y = StudyRunner.for_config(config)
    n = config["train_eval_examples"]  # the study's train loss batch
    probe = SharpnessProbe(runner.model, x[:n], y[:n], iterations, config["epsilon"])
    b = config["micro_batch_size"]
    idx = micro_batch_indices(len(x), b, config["train_examples"] // b, seed)
    stream, weights = (tf.constant(x[idx]), tf.constant(y[idx])), runner.initial_weights(seed)
    betas = config["beta_1"], config["beta_2"], config["epsilon"]
    chunk = config["train_examples"] // b // points
    rows = []
    for lr in learning_rates:
        probe.rows = []
        curve = run_method(runner, method, kappa, lr, weights, *stream, chunk, betas, probe)
        for point, probed in zip(curve[1:], probe.rows):
            s = probed["sharpness"]
            rows.append(
                {
                    "learning_rate": lr,
                    "examples": point["examples"],
                    "train_loss": point["train_loss"],
                    **probed,
                    "sharpness_x_lr": s * lr,
                }
            )
    return rows


def markdown(rows, config, run="kappa=1 (Adam)", kappa=8):
    """The probes, each rule's constant and its predicted breakdown lr."""
    beta_1 = config["beta_1"]
    lines = [
        f"Preconditioned sharpness S = lambda_max(P^-1 H), P = diag(sqrt(v_hat) + "
        f"{config['epsilon']:g}), along the {run} run; H of the train loss on "
        f"{config['train_eval_examples']} fixed training examples; lambda_max(H) unpreconditioned.",
        "",
        "| base lr | examples | train loss | lambda_max(H) | S | S x lr |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            report._row(
                [f"{r['learning_rate']:g}", str(r["examples"]), f"{r['train_loss']:.3f}"]
                + [f"{r[k]:.3g}" for k in ("hessian_top", "sharpness", "sharpness_x_lr")]
            )
        )
    lrs = sorted({r["learning_rate"] for r in rows})
    by_lr = [[r["sharpness_x_lr"] for r in rows if r["learning_rate"] == lr] for lr in lrs]
    peak, late = [max(v) for v in by_lr], [v[-1] for v in by_lr]
    lines += [
        "",
        "Stability threshold x base lr, (2 + 2 beta_1,k) lr / (lr_k (1 - beta_1,k)), "
        "and the base lr where S x lr crosses it (log-log interpolation between the "
        "measured lrs; S at its maximum over the run, or at the end):",
        "",
        "| rule | kappa | beta_1,k | threshold x lr | breakdown lr, max S | breakdown lr, end S |",
        "|---|---|---|---|---|---|",
    ]
    for k, rule in [(1, "invariant")] + [(kappa, r) for r in RULES]:
        c = sharpness.threshold_times_lr(k, rule, beta_1)
        beta_1_k = ka.scale_hyperparameters(k, rule, 1.0, beta_1)["beta_1"]
        cells = ["any" if k == 1 else rule, str(k), f"{beta_1_k:.3g}", f"{c:.3g}"]
        cells += [report.format_lr(lrs, report.crossing_lr(lrs, v, c)) for v in (peak, late)]
        lines.append(report._row(cells))
    return "\n".join(lines) + "\n"


def plot(rows, config, png, run="kappa=1 (Adam)", kappa=8):
    """S x lr versus examples, a line per base lr; dashed: the constants."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for lr in sorted({r["learning_rate"] for r in rows}):
        curve = [(r["examples"], r["sharpness_x_lr"]) for r in rows if r["learning_rate"] == lr]
        ax.plot(*zip(*curve), "o-", label=f"base lr {lr:g}")
    for k, rule in [(1, "invariant")] + [(kappa, r) for r in RULES]:
        c = sharpness.threshold_times_lr(k, rule, config["beta_1"])
        ax.axhline(c, color="k", linestyle="--", linewidth=0.8)
        label = f"kappa={k} {rule} " if k > 1 else f"kappa={k} "
        ax.text(1, c, label, transform=ax.get_yaxis_transform(), ha="right", va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel("examples seen")
    ax.set_ylabel("S x lr (S = lambda_max(P^-1 H))")
    ax.set_title(f"along the {run} run; dashed: stability threshold x lr", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    report.save_figure(fig, png)
    plt.close(fig)
