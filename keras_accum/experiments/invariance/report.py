"""The invariance study's analysis: spreads across kappa, the Markdown
tables and the figures (see `keras_accum.experiments.invariance`)."""

import csv
import math

import numpy as np

from keras_accum.experiments.study_runner import METRICS  # noqa: F401 (re-exported)
from keras_accum.training import atomic


def write_csv(path, rows):
    """`rows` (dicts with the same keys) as the CSV file `path`, atomically."""
    with atomic.replacing(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def spreads(rows, kappas):
    """{(method, lr, seed): {metric: (mean over points, at end)}}: max - min
    over `kappas` at matched examples, points with examples > 0."""
    table = {}
    for r in rows:
        if r["examples"] > 0 and r["kappa"] in kappas:
            key = (r["method"], r["learning_rate"], r["seed"])
            table.setdefault(key, {}).setdefault(r["examples"], {})[r["kappa"]] = r
    result = {}
    for key, by_examples in table.items():
        examples = sorted(by_examples)
        for e in examples:
            if set(by_examples[e]) != set(kappas):
                raise ValueError(
                    f"{key} at {e} examples has kappas {sorted(by_examples[e])}, not {kappas}"
                )
        result[key] = {}
        for metric in METRICS:
            per_point = [np.ptp([by_examples[e][k][metric] for k in kappas]) for e in examples]
            result[key][metric] = (float(np.mean(per_point)), float(per_point[-1]))
    return result


def mean_std(values):
    """(mean, std with ddof=1; nan for one value) of `values`."""
    values = np.asarray(values, dtype=float)
    std = values.std(ddof=1) if len(values) > 1 else float("nan")
    return float(values.mean()), float(std)


def summarize(rows, config):
    """A dict per (method, lr): spread mean and seed std of each metric
    (over the run and at the end), and at the smallest kappa the train loss
    at the start and the end and the final test accuracy (context: how far
    training went)."""
    s = spreads(rows, config["kappas"])
    k1 = min(config["kappas"])
    curves = {}
    for r in rows:
        if r["kappa"] == k1:
            curves.setdefault((r["method"], r["learning_rate"], r["seed"]), {})[r["examples"]] = r
    out = []
    for method in config["methods"]:
        for lr in config["learning_rates"]:
            entry = {"method": method, "learning_rate": lr}
            keys = [(method, lr, seed) for seed in config["seeds"]]
            for metric in METRICS:
                for i, when in enumerate(("mean", "end")):
                    entry[f"{metric}_{when}"] = mean_std([s[k][metric][i] for k in keys])
            ends = [curves[k][max(curves[k])] for k in keys]
            entry["start_loss"] = float(np.mean([curves[k][0]["train_loss"] for k in keys]))
            entry["end_loss"] = float(np.mean([e["train_loss"] for e in ends]))
            entry["end_accuracy"] = float(np.mean([e["test_accuracy"] for e in ends]))
            out.append(entry)
    return out


def _fmt(value):
    mean, std = value
    return f"{mean:.2e}" if math.isnan(std) else f"{mean:.2e} ± {std:.1e}"


def _row(cells):
    return "| " + " | ".join(cells) + " |"


def _full_table(summary_rows, config, seconds, cpu_seconds):
    k1 = min(config["kappas"])
    lines = [
        f"Spread across kappa = {config['kappas']} (max - min over kappa at "
        f"matched examples seen), micro-batch {config['micro_batch_size']}, "
        f"model `{config['model']}` on `{config['dataset']}`, "
        f"{config['train_examples']} examples per run, evaluated every "
        f"{config['eval_every']} examples; mean over "
        f"{len(config['seeds'])} seeds ± seed-to-seed std (ddof=1). "
        "'run' = averaged over the evaluation points after the start, "
        f"'end' = at the last one. Train loss on {config['train_eval_examples']}"
        " fixed training examples. Run time "
        f"{seconds / 60:.1f} min wall clock, {cpu_seconds / 60:.1f} min CPU"
        " (all threads).",
        "",
        "| method | base lr | train loss, run | train loss, end | "
        "test loss, run | test loss, end | test acc, run | test acc, end | "
        f"kappa={k1} train loss start → end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary_rows:
        cells = [e["method"], f"{e['learning_rate']:g}"]
        cells += [_fmt(e[f"{m}_{w}"]) for m in METRICS for w in ("mean", "end")]
        cells.append(f"{e['start_loss']:.3f} → {e['end_loss']:.3f}")
        lines.append(_row(cells))
    return lines


def _compact_table(summary_rows, config):
    """The figure's numbers, one column per method."""
    k1 = min(config["kappas"])
    methods, lrs = config["methods"], config["learning_rates"]
    by = {(e["method"], e["learning_rate"]): e for e in summary_rows}
    pair = {"invariant", "sqrt"} <= set(methods)
    lines = [
        "",
        "Train-loss spread averaged over the run (the y axis of "
        f"spread_vs_lr.png), and the kappa={k1} test accuracy at the "
        "end (which base lr one would pick at kappa = 1):",
        "",
        "| base lr | "
        + " | ".join(methods)
        + " |"
        + (" invariant / sqrt |" if pair else "")
        + f" kappa={k1} test acc |",
        "|---" * (len(methods) + 2 + pair) + "|",
    ]
    for lr in lrs:
        cells = [f"{lr:g}"] + [f"{by[m, lr]['train_loss_mean'][0]:.2e}" for m in methods]
        if pair:
            inv = by["invariant", lr]["train_loss_mean"][0]
            sq = by["sqrt", lr]["train_loss_mean"][0]
            cells.append(f"{inv / sq:.3f}" if sq > 0 else "n/a")
        cells.append(f"{by[methods[0], lr]['end_accuracy']:.3f}")
        lines.append(_row(cells))
    return lines


def _breakdown_table(rows, config):
    """Where invariance breaks: the same spread over kappa <= K."""
    kappas = sorted(config["kappas"])
    if len(kappas) <= 2:
        return []
    subsets = [kappas[:i] for i in range(2, len(kappas) + 1)]
    by_subset = [spreads(rows, sub) for sub in subsets]
    lines = [
        "",
        "Train-loss spread (mean over the run and the seeds) "
        "over the kappas up to K only, per method:",
        "",
        "| base lr | method | " + " | ".join(f"K={sub[-1]}" for sub in subsets) + " |",
        "|---|---" + "|---" * len(subsets) + "|",
    ]
    for lr in config["learning_rates"]:
        for m in config["methods"]:
            cells = [f"{lr:g}", m] + [
                f"{np.mean([sp[m, lr, seed]['train_loss'][0] for seed in config['seeds']]):.2e}"
                for sp in by_subset
            ]
            lines.append(_row(cells))
    return lines


# The frontier compares the largest window with one micro-batch per update;
# "invariant" while the gap stays within FRONTIER_RATIO seed-noise units.
FRONTIER_KAPPAS = (1, 8)
FRONTIER_RATIO = 2.0
FRONTIER_METRICS = ("train_loss", "test_loss")


def frontier(rows, config):
    """{(method, lr): {metric: (gap, noise, ratio)}} for kappa = 8 against
    kappa = 1, over the evaluation points with examples > 0:

        gap   = mean over seeds and points of |loss_8 - loss_1| (same seed:
                same initial weights and micro-batch stream)
        noise = mean over points of the seed std (ddof=1) of loss_1
        ratio = gap / noise

    {} when the config lacks kappa 1 or 8 or has fewer than 2 seeds."""
    k1 = FRONTIER_KAPPAS[0]
    if not set(FRONTIER_KAPPAS) <= set(config["kappas"]) or len(config["seeds"]) < 2:
        return {}
    gaps = spreads(rows, list(FRONTIER_KAPPAS))  # max - min of two = |gap|
    curves = {}
    for r in rows:
        if r["kappa"] == k1 and r["examples"] > 0:
            key = (r["method"], r["learning_rate"], r["seed"])
            curves.setdefault(key, {})[r["examples"]] = r
    out = {}
    for method in config["methods"]:
        for lr in config["learning_rates"]:
            keys = [(method, lr, seed) for seed in config["seeds"]]
            points = sorted(curves[keys[0]])
            out[method, lr] = {}
            for metric in FRONTIER_METRICS:
                gap = float(np.mean([gaps[k][metric][0] for k in keys]))
                k1_losses = [[curves[k][e][metric] for k in keys] for e in points]
                noise = float(np.mean([mean_std(v)[1] for v in k1_losses]))
                ratio = gap / noise if noise > 0 else math.inf
                out[method, lr][metric] = (gap, noise, ratio)
    return out


def frontier_lr(table, method, metric="train_loss"):
    """The largest base lr whose ratio is <= FRONTIER_RATIO, or None."""
    lrs = [lr for (m, lr), e in table.items() if m == method and e[metric][2] <= FRONTIER_RATIO]
    return max(lrs, default=None)


def crossing_lr(lrs, values, level):
    """The lr where `values` (at increasing `lrs`) first rises through
    `level`, linear in (log lr, log value) between neighbours; 0 when
    already above at lrs[0], inf when never reached."""
    if values[0] > level:
        return 0.0
    for (lr_a, a), (lr_b, b) in zip(zip(lrs, values), zip(lrs[1:], values[1:])):
        if b > level >= a:
            f = (math.log(level) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(lr_a) + f * (math.log(lr_b) - math.log(lr_a)))
    return math.inf


def format_lr(lrs, lr):
    """A `crossing_lr` result for a table: bounds as "< lrs[0]", "> lrs[-1]"."""
    return f"< {lrs[0]:g}" if lr == 0 else f"> {lrs[-1]:g}" if math.isinf(lr) else f"{lr:.2g}"


def _frontier_table(rows, config):
    table = frontier(rows, config)
    if not table:
        return []
    k1, k8 = FRONTIER_KAPPAS
    lines = [
        "",
        f"Frontier: kappa={k8} against kappa={k1}, same seed (same initial "
        "weights and micro-batch stream). gap = mean over seeds and "
        f"evaluation points (examples > 0) of |loss(kappa={k8}) - "
        f"loss(kappa={k1})|; noise = mean over the points of the seed-to-seed "
        f"std (ddof=1) of loss(kappa={k1}); ratio = gap / noise:",
        "",
        "| method | base lr | train gap | train noise | train ratio | "
        "test gap | test noise | test ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (method, lr), e in table.items():
        cells = [method, f"{lr:g}"]
        for metric in FRONTIER_METRICS:
            gap, noise, ratio = e[metric]
            cells += [f"{gap:.2e}", f"{noise:.2e}", f"{ratio:.2f}"]
        lines.append(_row(cells))
    lines += [
        "",
        f"Largest base lr at which kappa={k8} stays within {FRONTIER_RATIO:g}x "
        f"its kappa={k1} seed-to-seed spread (ratio <= {FRONTIER_RATIO:g}), "
        "and where the train ratio first rises through it (linear in log ratio "
        "and log lr between neighbouring lrs):",
        "",
        "| method | train loss | test loss | train ratio crosses 2 at |",
        "|---|---|---|---|",
    ]
    lrs = sorted(config["learning_rates"])
    for method in config["methods"]:
        best = [frontier_lr(table, method, m) for m in FRONTIER_METRICS]
        ratios = [table[method, lr]["train_loss"][2] for lr in lrs]
        crossing = crossing_lr(lrs, ratios, FRONTIER_RATIO)
        cells = ["none" if lr is None else f"{lr:g}" for lr in best]
        lines.append(_row([method] + cells + [format_lr(lrs, crossing)]))
    return lines


def _noise_table(noise_rows, config):
    b = config["micro_batch_size"]
    lines = [
        "",
        f"Gradient noise scale B_simple (`GradientNoiseScale`, "
        f"{config['noise_scale_windows']} probe windows of "
        f"{config['noise_scale_kappa']} x {b}"
        f" training examples, EMA {config['noise_scale_ema']}), mean ± "
        f"std over seeds; windows here are kappa x {b} = "
        f"{', '.join(str(k * b) for k in config['kappas'])}"
        " examples:",
        "",
        "| model | B_simple | tr(Sigma) | abs(G)^2 |",
        "|---|---|---|---|",
    ]
    groups = {}
    for r in noise_rows:
        label = r["model"] + (f", lr {r['learning_rate']:g}" if r["learning_rate"] != "" else "")
        groups.setdefault(label, []).append(r)
    for label, rs in groups.items():
        cells = [label] + [
            _fmt(mean_std([r[k] for r in rs])).replace("e+", "e")
            for k in ("noise_scale", "trace_sigma", "grad_sq_norm")
        ]
        lines.append(_row(cells))
    return lines


def markdown_report(summary_rows, noise_rows, config, seconds, cpu_seconds, rows):
    """The spread tables and the noise scale, in Markdown."""
    lines = (
        _full_table(summary_rows, config, seconds, cpu_seconds)
        + _compact_table(summary_rows, config)
        + _breakdown_table(rows, config)
        + _frontier_table(rows, config)
        + _noise_table(noise_rows, config)
    )
    return "\n".join(lines) + "\n"


# -- plots --------------------------------------------------------------------


def save_figure(fig, png):
    """Saves `fig` as the PNG file `png` atomically."""
    with atomic.replacing(png, "wb") as f:
        fig.savefig(f, format="png", dpi=100)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spread(summary_rows, config, png):
    """Spread (mean over the run) versus base lr, a line per method."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
    for ax, metric in zip(axes, METRICS):
        for method in config["methods"]:
            es = [e for e in summary_rows if e["method"] == method]
            mean = np.array([e[f"{metric}_mean"][0] for e in es])
            std = np.nan_to_num([e[f"{metric}_mean"][1] for e in es])
            lrs = [e["learning_rate"] for e in es]
            ax.errorbar(lrs, mean, yerr=std, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        ax.set_xticks(config["learning_rates"], [f"{lr:g}" for lr in config["learning_rates"]])
        ax.xaxis.set_minor_formatter("")
        if all(e[f"{metric}_mean"][0] > 0 for e in summary_rows):
            ax.set_yscale("log")
        ax.set_xlabel("base learning rate (kappa = 1)")
        ax.set_ylabel(f"spread of {metric.replace('_', ' ')} across kappa")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"max - min over kappa = {config['kappas']}, mean over the "
        f"run and over {len(config['seeds'])} seeds (bars: seed std)"
    )
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)


def plot_frontier(rows, config, png):
    """The frontier ratio (gap / seed noise) versus base lr, a line per
    method, a panel per loss; False (nothing written) without a frontier."""
    table = frontier(rows, config)
    if not table:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(FRONTIER_METRICS), figsize=(11, 4.2))
    lrs = config["learning_rates"]
    for ax, metric in zip(axes, FRONTIER_METRICS):
        for method in config["methods"]:
            ax.plot(lrs, [table[method, lr][metric][2] for lr in lrs], marker="o", label=method)
        ax.axhline(FRONTIER_RATIO, color="k", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
        ax.xaxis.set_minor_formatter("")
        ax.set_xlabel("base learning rate (kappa = 1)")
        ax.set_ylabel(f"{metric.replace('_', ' ')}: gap / seed noise")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    k1, k8 = FRONTIER_KAPPAS
    fig.suptitle(
        f"mean |loss(kappa={k8}) - loss(kappa={k1})| over the mean seed std at "
        f"kappa={k1} ({len(config['seeds'])} seeds); dashed: {FRONTIER_RATIO:g}"
    )
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)
    return True


def plot_method_curves(rows, config, lr, png):
    """Train loss and test accuracy versus examples seen at base lr `lr`:
    a column per method, a line per kappa (mean over seeds)."""
    plt = pyplot()
    methods = config["methods"]
    fig, axes = plt.subplots(
        2, len(methods), figsize=(4 * len(methods), 7), sharey="row", squeeze=False
    )
    for col, method in enumerate(methods):
        for kappa in config["kappas"]:
            curve = {}
            for r in rows:
                if (r["method"], r["learning_rate"], r["kappa"]) == (method, lr, kappa):
                    curve.setdefault(r["examples"], []).append(r)
            examples = sorted(curve)
            for row, metric in enumerate(("train_loss", "test_accuracy")):
                axes[row, col].plot(
                    examples,
                    [np.mean([r[metric] for r in curve[e]]) for e in examples],
                    label=f"kappa={kappa}",
                )
        axes[0, col].set_title(method)
        for row in range(2):
            axes[row, col].set_xlabel("examples seen")
            axes[row, col].grid(True, alpha=0.3)
        axes[0, col].legend()
    axes[0, 0].set_ylabel("train loss")
    axes[1, 0].set_ylabel("test accuracy")
    fig.suptitle(
        f"base lr {lr:g} (tuned at kappa = 1), micro-batch "
        f"{config['micro_batch_size']}, mean over "
        f"{len(config['seeds'])} seeds"
    )
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)
