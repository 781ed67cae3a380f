"""The batch-size schedules study's analysis: tables and figures
(see `keras_accum.experiments.schedules_study`)."""

import numpy as np

from keras_accum.experiments.invariance.report import _pyplot, save_figure
from keras_accum.training import atomic

LOSSES = ("train_loss", "test_loss")


def _mean_std(values):
    values = np.asarray(values, dtype=float)
    std = values.std(ddof=1) if len(values) > 1 else float("nan")
    return float(values.mean()), float(std)


def _fmt(mean_std, digits=2):
    mean, std = mean_std
    return f"{mean:.{digits}e} ± {std:.1e}"


def _curves(rows, experiment):
    """{(method, lr, seed, run): {examples: row}}."""
    out = {}
    for r in rows:
        if r["experiment"] == experiment:
            key = (r["method"], r["learning_rate"], r["seed"], r["run"])
            out.setdefault(key, {})[r["examples"]] = r
    return out


def switch_summary(rows, config):
    """A dict per (method, lr): over the evaluation points after the switch,
    per seed then mean ± std over seeds, for each loss: `spread_const`
    (|kappa=1 - kappa=8|), `spread_all` (max - min of kappa=1, kappa=8 and
    the switch), `ratio` (spread_all / spread_const), `offset` (|switch -
    kappa=1|) and `jump` (switch - kappa=1 at the first point after it)."""
    curves = _curves(rows, "switch")
    k8 = f"kappa={config['switch_kappa']}"
    out = []
    for method in config["switch_methods"]:
        for lr in config["switch_learning_rates"]:
            entry = {"method": method, "learning_rate": lr}
            for metric in LOSSES:
                stats = {
                    "spread_const": [],
                    "spread_all": [],
                    "ratio": [],
                    "offset": [],
                    "jump": [],
                }
                for seed in config["seeds"]:
                    runs = [curves[(method, lr, seed, run)] for run in ("kappa=1", k8, "switch")]
                    after = [e for e in sorted(runs[0]) if e > config["switch_examples"]]
                    values = np.array([[run[e][metric] for e in after] for run in runs])
                    const = np.abs(values[0] - values[1]).mean()
                    spread = np.ptp(values, axis=0).mean()
                    stats["spread_const"].append(const)
                    stats["spread_all"].append(spread)
                    stats["ratio"].append(spread / const)
                    stats["offset"].append(np.abs(values[2] - values[0]).mean())
                    stats["jump"].append(values[2][0] - values[0][0])
                for name, values in stats.items():
                    entry[f"{metric}_{name}"] = _mean_std(values)
            out.append(entry)
    return out


def adaptive_summary(rows, config):
    """A dict per (lr, run): final losses and accuracy, updates (mean ± std
    over seeds)."""
    curves = _curves(rows, "adaptive")
    out = []
    for lr in config["adaptive_learning_rates"]:
        runs = sorted({k[3] for k in curves if k[1] == lr}, key=_run_order)
        for run in runs:
            ends = [max(v.items())[1] for k, v in curves.items() if k[1] == lr and k[3] == run]
            entry = {"learning_rate": lr, "run": run}
            for metric in ("train_loss", "test_loss", "test_accuracy", "updates"):
                entry[metric] = _mean_std([e[metric] for e in ends])
            out.append(entry)
    return out


def _run_order(run):
    return (run == "adaptive", int(run.split("=")[1]) if "=" in run else 0)


def markdown(switch_rows, adaptive_rows, config, decisions):
    c = config
    lines = [
        f"`{c['dataset']}`, model `{'char_lm' if c['dataset'] == 'char_corpus' else c['model']}`, "
        f"micro-batch {c['micro_batch_size']}, "
        f"{c['train_examples']} examples per run, evaluated every {c['eval_every']}; "
        f"mean ± seed std over seeds {c['seeds']}.",
        "",
        f"## Switch kappa = 1 -> {c['switch_kappa']} at {c['switch_examples']} examples",
        "",
        "Over the evaluation points after the switch: `spread const` = mean |kappa=1 - "
        f"kappa={c['switch_kappa']}|, `ratio` = mean max-min of the three runs / spread "
        "const (the issue's target: <= 2), `offset` = mean |switch - kappa=1|, `jump` = "
        "switch - kappa=1 at the first point after the switch.",
        "",
        "| method | base lr | loss | spread const | ratio | offset | jump |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in switch_rows:
        for metric in LOSSES:
            lines.append(
                f"| {e['method']} | {e['learning_rate']:g} | {metric.replace('_', ' ')} | "
                f"{_fmt(e[f'{metric}_spread_const'])} | "
                f"{e[f'{metric}_ratio'][0]:.2f} ± {e[f'{metric}_ratio'][1]:.2f} | "
                f"{_fmt(e[f'{metric}_offset'])} | {_fmt(e[f'{metric}_jump'])} |"
            )
    lines += [
        "",
        f"## Adaptive kappa (AdaptiveSteps(1, {c['adaptive_max_steps']}), power rule)",
        "",
        "| base lr | run | train loss | test loss | test accuracy | updates |",
        "|---|---|---|---|---|---|",
    ]
    for e in adaptive_rows:
        lines.append(
            f"| {e['learning_rate']:g} | {e['run']} | {_fmt(e['train_loss'], 3)} | "
            f"{_fmt(e['test_loss'], 3)} | {e['test_accuracy'][0]:.3f} ± "
            f"{e['test_accuracy'][1]:.3f} | {e['updates'][0]:.0f} ± {e['updates'][1]:.0f} |"
        )
    if decisions:
        lines += [
            "",
            "Decisions (seed, micro-step, B_simple estimate, its smoothed average over "
            "the estimates so far, steps from then on, why):",
            "",
        ]
        for d in decisions:
            if d["seed"] == c["seeds"][0]:
                lines.append(
                    f"* seed {d['seed']} lr {d['learning_rate']:g}: micro-step "
                    f"{d['micro_step']}, B_simple {d['b_simple']:.0f}, smoothed "
                    f"{d['smoothed']:.0f} over {d['observations']} -> steps {d['steps']} "
                    f"({d['reason']})"
                )
    return "\n".join(lines) + "\n"


def _mean_curve(curves, method, lr, run, metric, x="examples"):
    per_seed = [v for k, v in curves.items() if k[0] == method and k[1] == lr and k[3] == run]
    examples = sorted(per_seed[0])
    xs = np.mean([[c[e][x] for e in examples] for c in per_seed], axis=0)
    ys = np.mean([[c[e][metric] for e in examples] for c in per_seed], axis=0)
    return xs, ys


def plot_switch(rows, config, lr, png, metric="train_loss"):
    """Top: `metric` versus examples (mean over seeds) for kappa=1, kappa=8
    and the switch, a column per method; bottom: each minus kappa=1."""
    plt = _pyplot()
    curves = _curves(rows, "switch")
    methods = config["switch_methods"]
    fig, axes = plt.subplots(2, len(methods), figsize=(4.5 * len(methods), 7), squeeze=False)
    k8 = f"kappa={config['switch_kappa']}"
    for col, method in enumerate(methods):
        base = _mean_curve(curves, method, lr, "kappa=1", metric)
        for run, style in (("kappa=1", "-"), (k8, "--"), ("switch", "-")):
            xs, ys = _mean_curve(curves, method, lr, run, metric)
            axes[0, col].plot(xs, ys, style, label=run)
            axes[1, col].plot(xs, ys - base[1], style, label=f"{run} - kappa=1")
        for row in (0, 1):
            axes[row, col].axvline(config["switch_examples"], color="grey", lw=0.8)
            axes[row, col].grid(alpha=0.3)
            axes[row, col].set_xlabel("examples seen")
            axes[row, col].legend(fontsize=8)
        axes[0, col].set_title(method)
        axes[0, col].set_ylabel(metric.replace("_", " "))
        axes[1, col].set_ylabel("difference from kappa=1")
    fig.suptitle(
        f"kappa 1 -> {config['switch_kappa']} at {config['switch_examples']} examples "
        f"(grey line), base lr {lr:g}, mean over {len(config['seeds'])} seeds"
    )
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)


def plot_adaptive(rows, config, lr, png):
    """Test loss versus examples and versus updates; kappa versus examples."""
    plt = _pyplot()
    curves = _curves(rows, "adaptive")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = sorted({k[3] for k in curves if k[1] == lr}, key=_run_order)
    for run in runs:
        xs, ys = _mean_curve(curves, "power", lr, run, "test_loss")
        axes[0].plot(xs, ys, label=run)
        us, ys = _mean_curve(curves, "power", lr, run, "test_loss", x="updates")
        axes[1].plot(us, ys, label=run)
        xs, ks = _mean_curve(curves, "power", lr, run, "kappa")
        axes[2].step(xs, ks, where="post", label=run)
    for ax, xlabel, ylabel in zip(
        axes,
        ("examples seen", "updates (serial steps)", "examples seen"),
        ("test loss", "test loss", "window size kappa (mean over seeds)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"adaptive kappa vs constant, base lr {lr:g}, mean over seeds")
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)


def write_report(rows, decisions, config, workdir):
    switch_rows = switch_summary(rows, config)
    adaptive_rows = adaptive_summary(rows, config)
    atomic.atomic_write_text(
        workdir / "summary.md", markdown(switch_rows, adaptive_rows, config, decisions)
    )
    for lr in config["switch_learning_rates"]:
        plot_switch(rows, config, lr, workdir / f"switch_lr_{lr:g}.png")
    for lr in config["adaptive_learning_rates"]:
        plot_adaptive(rows, config, lr, workdir / f"adaptive_lr_{lr:g}.png")
