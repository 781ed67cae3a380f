"""The batch-size schedules study's analysis: tables and figures
(see `keras_accum.experiments.schedules_study`)."""

import json
import pathlib

import numpy as np

from keras_accum.experiments.invariance.report import mean_std, pyplot, save_figure, write_csv
from keras_accum.training import atomic

LOSSES = ("train_loss", "test_loss")


def _fmt(value, digits=2):
    mean, std = value
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
                    entry[f"{metric}_{name}"] = mean_std(values)
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
                entry[metric] = mean_std([e[metric] for e in ends])
            out.append(entry)
    return out


def _run_order(run):
    return (run == "adaptive", int(run.split("=")[1]) if "=" in run else 0)


def updates_to_target(points, target):
    """Serial updates at which the test loss first gets <= `target`,
    interpolated linearly between the evaluation points around that first
    crossing; None if never. `points` in training order."""
    for before, p in zip([None] + points[:-1], points):
        if p["test_loss"] <= target:
            if before is None:
                return float(p["updates"])
            f = (before["test_loss"] - target) / (before["test_loss"] - p["test_loss"])
            return before["updates"] + f * (p["updates"] - before["updates"])
    return None


def warmup_summary(rows, config, lr):
    """(T, σ): mean, std over seeds of the kappa=1 run's final test loss, and
    a dict per (method, run): final test loss and updates (mean ± std over
    seeds), per seed the updates to first reach T (`to_target`) and T + σ."""
    curves = _curves(rows, "warmup")
    runs = {}
    for (method, rate, _, run), points in sorted(curves.items()):
        if rate == lr:
            runs.setdefault((method, run), []).append([points[e] for e in sorted(points)])
    ones = next(v for (_, run), v in runs.items() if run == "kappa=1")
    target = mean_std([c[-1]["test_loss"] for c in ones])
    out = []
    for method in config["warmup_rules"] + ["sqrt"]:
        for run in config["warmup_schedules"]:
            run = run.replace("K", str(config["warmup_kappa"]))
            seeds, noisy = runs[(method, run)], target[0] + np.nan_to_num(target[1])
            entry = {"method": method, "run": run}
            for metric in ("test_loss", "updates"):
                entry[metric] = mean_std([c[-1][metric] for c in seeds])
            for name, t in (("to_target", target[0]), ("to_noise", noisy)):
                entry[name] = [updates_to_target(c, t) for c in seeds]
            out.append(entry)
    return target, out


def _reached(hits):
    got = [h for h in hits if h is not None]
    if not got:
        return "never"
    part = f" ({len(got)}/{len(hits)} seeds)" if len(got) < len(hits) else ""
    return f"{np.mean(got):.0f} ± {np.std(got, ddof=min(1, len(got) - 1)):.0f}{part}"


def warmup_markdown(rows, config):
    c, k = config, config["warmup_kappa"]
    kappas = ", ".join(f"{2**i} from {m}" for i, m in enumerate([0] + c["warmup_boundaries"]))
    lines = [
        f"## Batch-size warmup to K = {k} (nothing retuned)",
        "",
        f"piecewise: kappa {kappas} (micro-steps); adaptive: AdaptiveSteps(1, {k}, "
        "powers_of_two=True). T, σ: mean, std over seeds of kappa=1's final test "
        "loss; `to T`, `to T+σ`: updates to first reach it (linear interpolation between "
        "evaluations; over the seeds that do); `saved` = 1 - (to T+σ) / kappa=1's updates, "
        "shown when every seed reaches T+σ.",
    ]
    for lr in c["warmup_learning_rates"]:
        (t, sigma), entries = warmup_summary(rows, c, lr)
        full, met = entries[0]["updates"][0], []
        lines += ["", f"Base lr {lr:g}: T = {t:.4f}, σ = {sigma:.4f}.", ""]
        lines += ["| method | run | final test loss | updates | to T | to T+σ | saved |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for e in entries:
            hits = e["to_noise"]
            saved = 1 - np.mean(hits) / full if None not in hits else float("nan")
            lines.append(
                f"| {e['method']} | {e['run']} | {e['test_loss'][0]:.4f} ± "
                f"{e['test_loss'][1]:.4f} | {e['updates'][0]:.0f} ± {e['updates'][1]:.0f} | "
                f"{_reached(e['to_target'])} | {_reached(hits)} | "
                + ("— |" if saved != saved else f"{saved:.0%} |")
            )
            met += [f"{e['method']} {e['run']}"] * bool(saved >= 0.4 and e["run"] != "kappa=1")
        lines += ["", f"Reach T+σ in every seed with >= 40% fewer updates: {met or 'none'}."]
    return "\n".join(lines) + "\n"


def plot_warmup(rows, config, lr, png):
    """Test loss versus serial updates and versus examples, mean over seeds."""
    plt = pyplot()
    curves = _curves(rows, "warmup")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for method, run in sorted({(k[0], k[3]) for k in curves if k[1] == lr}):
        if run != "kappa=1" or method == config["warmup_rules"][0]:  # kappa=1: shared
            label = "kappa=1" if run == "kappa=1" else f"{method} {run}"
            for ax, x in zip(axes, ("updates", "examples")):
                xs, ys = _mean_curve(curves, method, lr, run, "test_loss", x=x)
                ax.plot(xs[1:], ys[1:], "--" if method == "sqrt" else "-", label=label)
    for ax, x in zip(axes, ("serial updates (log)", "examples seen")):
        ax.set(xlabel=x, ylabel="validation (test) loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_xscale("log")
    fig.suptitle(f"warmup to K = {config['warmup_kappa']}, base lr {lr:g}, mean over seeds")
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)


def markdown(switch_rows, adaptive_rows, config, decisions):
    c = config
    lines = [
        f"`{c['dataset']}`, model `{'char_lm' if c['dataset'] == 'char_corpus' else c['model']}`, "
        f"micro-batch {c['micro_batch_size']}, "
        f"{c['train_examples']} examples per run, evaluated every {c['eval_every']}; "
        f"mean ± seed std over seeds {c['seeds']}.",
        "",
    ]
    if not c["switch_learning_rates"] and not c["adaptive_learning_rates"]:
        return "\n".join(lines)
    lines += [
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
    plt = pyplot()
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
    plt = pyplot()
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
    text = markdown(switch_rows, adaptive_rows, config, decisions)
    if config["warmup_learning_rates"]:
        text += "\n" + warmup_markdown(rows, config)
    atomic.atomic_write_text(workdir / "summary.md", text)
    for lr in config["warmup_learning_rates"]:
        plot_warmup(rows, config, lr, workdir / f"warmup_lr_{lr:g}.png")
    for lr in config["switch_learning_rates"]:
        plot_switch(rows, config, lr, workdir / f"switch_lr_{lr:g}.png")
    for lr in config["adaptive_learning_rates"]:
        plot_adaptive(rows, config, lr, workdir / f"adaptive_lr_{lr:g}.png")


def merge(workdirs, out):
    """One report of finished studies run apart (seeds or warmup lrs split
    over processes): their rows, seeds and lrs together, else the first
    one's config."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, rows, decisions = None, [], []
    for workdir in map(pathlib.Path, workdirs):
        part = json.loads((workdir / "config.json").read_text())
        config = config or {**part, "seeds": [], "warmup_learning_rates": []}
        for key in ("seeds", "warmup_learning_rates"):
            config[key] += [s for s in part[key] if s not in config[key]]
        for name, out_rows in (("runs.csv", rows), ("warmup_decisions.csv", decisions)):
            if (workdir / name).exists():
                table = np.genfromtxt(
                    workdir / name, delimiter=",", names=True, dtype=None, encoding=None
                )
                out_rows += [dict(zip(table.dtype.names, r)) for r in table.tolist()]
    atomic.atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    write_csv(out / "runs.csv", rows)
    if decisions:
        write_csv(out / "warmup_decisions.csv", decisions)
    config["warmup_learning_rates"].sort()
    write_report(rows, [], config, out)
