"""The controls table of `schedules_controls`, recomputed from its files.

Everything here reads only a study folder's `runs.csv[.gz]`,
`decisions.csv[.gz]`, `timings.csv` and `config.json`, so each number in
docs/BATCH_SIZE_SCHEDULES.md's controls section can be recomputed from the
committed files (`python3 -m keras_accum.experiments.controls_report DIR`).

Criteria, per seed, on the test loss (T, sigma: mean and seed std, ddof 1,
of the reference arm's final test loss; the report gives two tables, with
constant kappa = 1 and with the stronger cosine-decayed kappa = 1 as the
reference):

* `first`: serial updates at which the test loss first gets <= T + sigma
  (linear interpolation between evaluations);
* `settled`: the updates at the first evaluation from which the trailing
  mean of the last 3 evaluations stays <= T + sigma to the end;
* `final`: the final test loss, and its difference to the reference arm
  with a Welch 95% confidence interval.

Costs beside updates: gradient evaluations (micro-batches trained plus the
noise-scale probes' micro-batches) and wall seconds of training and probing
(evaluations excluded), both at the end of the run and at first reach.
"""

import csv
import gzip
import json
import math
import pathlib
import sys

import numpy as np
from scipy import stats

from keras_accum.training import atomic

REFERENCE = "kappa=1"
COSINE = "kappa=1 cosine"  # the stronger baseline: a second threshold
WSD = "kappa=1 wsd"  # warmup-stable-decay (issue #42)
SPIKE_EVALUATIONS = 4  # `peak`: the largest jump over this many evaluations after a switch
TRAILING = 3
_FLOATS = (
    "learning_rate",
    "seconds",
    "cpu_seconds",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "val_loss",
    "smoothed",
)


def _open(path):
    path = pathlib.Path(path)
    if not path.exists() and path.with_suffix(path.suffix + ".gz").exists():
        path = path.with_suffix(path.suffix + ".gz")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="")
    return open(path, newline="")


def _value(key, text):
    if key in ("arm", "estimate", "reason"):
        return text
    if key in _FLOATS or key.startswith("b_"):
        return float(text) if text else math.nan  # empty: not measured
    return int(text)


def read_csv(path):
    with _open(path) as f:
        return [{k: _value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def load(workdir):
    """(config, rows, decisions, timings) of a study folder; a missing
    decisions file is []."""
    workdir = pathlib.Path(workdir)
    config = json.loads((workdir / "config.json").read_text())
    rows = read_csv(workdir / "runs.csv")
    try:
        decisions = read_csv(workdir / "decisions.csv")
    except FileNotFoundError:
        decisions = []
    timings = read_csv(workdir / "timings.csv")
    return config, rows, decisions, timings


def curves(rows):
    """{(arm, learning_rate, seed, rerun): points in training order}."""
    out = {}
    for r in rows:
        out.setdefault((r["arm"], r["learning_rate"], r["seed"], r["rerun"]), []).append(r)
    return {k: sorted(v, key=lambda p: p["examples"]) for k, v in out.items()}


def arm_curves(rows, arm, lr=None):
    """{seed: points} of `arm` (first runs, not reruns) at `lr` (default:
    its only learning rate)."""
    found = {(k[1], k[2]): v for k, v in curves(rows).items() if k[0] == arm and k[3] == 0}
    rates = sorted({rate for rate, _ in found})
    if lr is None:
        if len(rates) != 1:
            raise ValueError(f"arm {arm!r} has learning rates {rates}: name one")
        lr = rates[0]
    return {seed: v for (rate, seed), v in sorted(found.items()) if rate == lr}


def target(rows, arm=REFERENCE, lr=None, metric="test_loss"):
    """(T, sigma): mean and std (ddof 1) over seeds of `arm`'s final `metric`."""
    finals = [c[-1][metric] for c in arm_curves(rows, arm, lr).values()]
    return float(np.mean(finals)), float(np.std(finals, ddof=1))


def first_reach(points, threshold, x="updates", metric="test_loss"):
    """`x` at which `metric` first gets <= threshold, interpolated linearly
    between the evaluations around the crossing; None if never."""
    for before, p in zip([None, *points[:-1]], points):
        if p[metric] <= threshold:
            if before is None:
                return float(p[x])
            f = (before[metric] - threshold) / (before[metric] - p[metric])
            return before[x] + f * (p[x] - before[x])
    return None


def settled(points, threshold, x="updates", metric="test_loss", window=TRAILING):
    """`x` at the first evaluation from which the trailing mean of `window`
    evaluations stays <= threshold to the end; None if the last is above."""
    values = [p[metric] for p in points]
    means = [np.mean(values[i + 1 - window : i + 1]) for i in range(window - 1, len(values))]
    found = None
    for i in range(len(means) - 1, -1, -1):
        if means[i] > threshold:
            break
        found = i + window - 1
    return None if found is None else float(points[found][x])


def welch(a, b, level=0.95):
    """(mean(a) - mean(b), low, high): Welch's t interval of the difference."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    diff, se = a.mean() - b.mean(), math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.5 + level / 2, df) * se
    return float(diff), float(diff - half), float(diff + half)


def arm_summary(rows, timings, arm, threshold, reference_finals, lr=None):
    """A dict of the three criteria and the costs of `arm` (one entry per
    seed where per-seed)."""
    runs = arm_curves(rows, arm, lr)
    seeds = sorted(runs)
    finals = [runs[s][-1]["test_loss"] for s in seeds]
    timed = [
        t
        for t in timings
        if t["arm"] == arm and t["rerun"] == 0 and (lr is None or t["learning_rate"] == lr)
    ]
    seconds = {t["seed"]: t["seconds"] for t in timed}
    cpu = {t["seed"]: t["cpu_seconds"] for t in timed}
    entry = {
        "arm": arm,
        "learning_rate": runs[seeds[0]][0]["learning_rate"],
        "seeds": seeds,
        "final": finals,
        "updates": [runs[s][-1]["updates"] for s in seeds],
        "gradient_evaluations": [runs[s][-1]["gradient_evaluations"] for s in seeds],
        "seconds": [seconds[s] for s in seeds],
        "cpu_seconds": [cpu[s] for s in seeds],
        "welch": welch(finals, reference_finals),
    }
    for name, fn in (("first", first_reach), ("settled", settled)):
        for x in ("updates", "gradient_evaluations", "seconds", "cpu_seconds"):
            entry[f"{name}_{x}"] = [fn(runs[s], threshold, x) for s in seeds]
    return entry


def _mean_std(values, digits=0):
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    text = f"{np.mean(got):.{digits}f}"
    if len(got) > 1:
        text += f" ± {np.std(got, ddof=1):.{digits}f}"
    if len(got) < len(values):
        text += f" ({len(got)} of {len(values)})"
    return text


def controls_table(workdir, reference=REFERENCE):
    """(T, sigma, [arm_summary per arm in the config's order]) of a study
    folder; T and sigma from the reference arm's final test losses."""
    config, rows, _, timings = load(workdir)
    return _table(rows, timings, config["arms"], reference)


def combined_table(workdirs, reference, arms=None):
    """`controls_table` of several study folders read as one (their rows
    and timings joined): arms run in a later process against a reference
    run in an earlier one. `arms` (default: every arm of the folders'
    configs, in their order) picks and orders the rows."""
    rows, timings, order = [], [], []
    for workdir in workdirs:
        config, more_rows, _, more_timings = load(workdir)
        rows += more_rows
        timings += more_timings
        order += [a for a in config["arms"] if a not in order]
    return _table(rows, timings, order if arms is None else arms, reference)


def _table(rows, timings, arms, reference):
    t, sigma = target(rows, reference)
    reference_finals = [c[-1]["test_loss"] for c in arm_curves(rows, reference).values()]
    arms = [a for a in arms if any(r["arm"] == a for r in rows)]
    entries = [
        arm_summary(rows, timings, arm, t + sigma, reference_finals)
        for arm in arms
        if len({r["learning_rate"] for r in rows if r["arm"] == arm}) == 1
    ]
    return t, sigma, entries


def table_markdown(t, sigma, entries, reference=REFERENCE):
    ref = next(e for e in entries if e["arm"] == reference)
    ref_first = np.mean([v for v in ref["first_updates"] if v is not None])
    ref_settled = np.mean([v for v in ref["settled_updates"] if v is not None])
    lines = [
        f"T = {t:.4f} (mean final test loss of {reference}), sigma = {sigma:.4f} (its seed "
        f"std); threshold T + sigma = {t + sigma:.4f}. Mean ± seed std; (n of N): seeds "
        "that get there.",
        "",
        f"| arm | seeds | final test loss | diff to {reference} [95% CI] | first reach: updates "
        "| settled: updates | updates | gradient evaluations | CPU s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        diff, low, high = e["welch"]
        ci = "-" if e["arm"] == reference else f"{diff:+.4f} [{low:+.4f}, {high:+.4f}]"
        lines.append(
            f"| {e['arm']} | {len(e['seeds'])} | {_mean_std(e['final'], 4)} | {ci} | "
            f"{_mean_std(e['first_updates'])} | {_mean_std(e['settled_updates'])} | "
            f"{_mean_std(e['updates'])} | {_mean_std(e['gradient_evaluations'])} | "
            f"{np.median(e['cpu_seconds']):.1f} | {np.median(e['seconds']):.1f} |"
        )
    lines += [
        "",
        f"Savings against {reference}, like for like (mean over the seeds that get there):",
        "",
        "| arm | first reach: updates (saving) | settled: updates (saving) | first reach: "
        "gradient evaluations | first reach: CPU s |",
        "|---|---|---|---|---|",
    ]
    for e in entries:
        cells = []
        for name, ref_mean in (("first", ref_first), ("settled", ref_settled)):
            got = [v for v in e[f"{name}_updates"] if v is not None]
            n = f" ({len(got)} of {len(e['seeds'])})"
            cells.append(
                f"{np.mean(got):.0f} ({1 - np.mean(got) / ref_mean:+.0%}){n}" if got else "never"
            )
        cells.append(_mean_std(e["first_gradient_evaluations"]))
        cells.append(_mean_std(e["first_cpu_seconds"], 1))
        lines.append(f"| {e['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tuning_table(workdir, metric="val_loss"):
    """Markdown: final `metric` (mean ± seed std) per arm and learning rate."""
    _, rows, _, _ = load(workdir)
    finals = {}
    for (arm, lr, _, rerun), points in curves(rows).items():
        if not rerun:
            finals.setdefault((arm, lr), []).append(points[-1][metric])
    lines = [f"| arm | base lr | seeds | final {metric} |", "|---|---|---|---|"]
    for (arm, lr), values in sorted(finals.items()):
        lines.append(f"| {arm} | {lr:g} | {len(values)} | {_mean_std(values, 4)} |")
    return "\n".join(lines) + "\n"


def best_learning_rate(workdir, arm, metric="val_loss"):
    """The learning rate with the lowest mean final `metric` of `arm`."""
    _, rows, _, _ = load(workdir)
    finals = {}
    for (name, lr, _, rerun), points in curves(rows).items():
        if name == arm and not rerun:
            finals.setdefault(lr, []).append(points[-1][metric])
    return min(finals, key=lambda lr: np.mean(finals[lr]))


def gap_to_best_constant_lr(workdir, arm=COSINE):
    """(gap, best): how far `arm`'s mean final test loss lies below that of
    `best`, the best constant-lr arm on the same examples (the config's
    arms with neither a `decay` nor their own `examples`); positive when
    `arm` ends lower."""
    config, rows, _, _ = load(workdir)
    means = {
        name: float(np.mean([c[-1]["test_loss"] for c in arm_curves(rows, name).values()]))
        for name, spec in config["arms"].items()
        if name == arm or not ({"decay", "examples"} & set(spec))
    }
    best = min((name for name in means if name != arm), key=means.get)
    return means[best] - means[arm], best


def rerun_difference(rows, metrics=("train_loss", "val_loss", "test_loss")):
    """{arm: max |rerun - first run|} over the evaluations and `metrics` of
    each rerun (the same seed and lr twice in one process)."""
    all_curves, out = curves(rows), {}
    for (arm, lr, seed, rerun), points in all_curves.items():
        if rerun:
            first = all_curves[(arm, lr, seed, 0)]
            out[arm] = max(abs(p[m] - q[m]) for p, q in zip(points, first) for m in metrics)
    return out


def folder_difference(workdir_a, workdir_b, metrics=("train_loss", "val_loss", "test_loss")):
    """{(arm, lr, seed): max |a - b|} over the first runs that both folders
    hold (two processes, the same config: determinism across processes)."""
    a, b = (curves(load(w)[1]) for w in (workdir_a, workdir_b))
    out = {}
    for key in sorted(set(a) & set(b)):
        if not key[3]:
            pairs = zip(a[key], b[key])
            out[key[:3]] = max(abs(p[m] - q[m]) for p, q in pairs for m in metrics)
    return out


def replay_decisions(estimates, micro_batch_size, max_steps, smoothing=0.9, min_observations=4):
    """The sizes `AdaptiveSteps(1, max_steps, micro_batch_size, smoothing,
    min_observations, powers_of_two=True)` decides from `estimates` (numpy;
    to ask what another estimate of the same probes would have decided)."""
    ema, count, steps, out = 0.0, 0, 1, []
    for b in estimates:
        if not math.isnan(b):
            b = min(max(b, 0.0), max_steps * micro_batch_size)
            ema, count = smoothing * ema + (1 - smoothing) * b, count + 1
        if count >= min_observations:
            target = math.ceil(ema / (1 - smoothing**count) / micro_batch_size)
            target = 2 ** math.ceil(math.log2(max(target, 1)) - 1e-9)
            steps = max(steps, min(max(target, 1), max_steps))
        out.append(steps)
    return out


def decision_summary(workdir):
    """Markdown: per adaptive arm and seed, the micro-steps at which kappa
    changed, and what the other estimate of the same probes would have
    decided (replayed with the arm's rule)."""
    config, _, decisions, _ = load(workdir)
    if not decisions:
        return ""
    b, top = config["micro_batch_size"], config["max_kappa"]
    lines = [
        "| arm | seed | kappa changes (micro-step: kappa), as run | replayed from the other "
        "estimate |",
        "|---|---|---|---|",
    ]
    runs = {}
    for d in decisions:
        if not d["rerun"]:
            runs.setdefault((d["arm"], d["seed"]), []).append(d)
    for (arm, seed), ds in sorted(runs.items()):
        rule = {"smoothing": 0.9, "min_observations": 4}
        rule.update(
            {
                k: v
                for k, v in config["arms"][arm].get("adaptive", {}).items()
                if k in ("smoothing", "min_observations")
            }
        )
        other = next(k for k in ds[0] if k.startswith("b_") and k != f"b_{ds[0]['estimate']}")
        replay = replay_decisions([d[other] for d in ds], b, top, **rule)
        at = [d["micro_step"] for d in ds]
        lines.append(
            f"| {arm} | {seed} | {_changes(at, [d['steps'] for d in ds])}"
            f" | {other[2:]}: {_changes(at, replay)} |"
        )
    return "\n".join(lines) + "\n"


def _changes(steps_at, sizes):
    out, last = [], 1
    for at, size in zip(steps_at, sizes):
        if size != last:
            out.append(f"{at}: {size}")
            last = size
    return ", ".join(out) or "none"


def merge(workdirs, out):
    """One folder from studies run as several processes: their rows,
    decisions and timings concatenated (a column one lacks left empty), the
    first config with every arm's seeds and learning rates joined, and the
    configs as run in `merged_from`; then `write_report`."""
    from keras_accum.experiments.invariance.report import write_csv

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = [load(w) for w in workdirs]
    config = json.loads(json.dumps(loaded[0][0]))
    for other, *_ in loaded[1:]:
        for name, arm in other["arms"].items():
            mine = config["arms"].setdefault(name, dict(arm))
            for key, default in (("seeds", other["seeds"]), ("learning_rates", None)):
                default = default or other["learning_rates"]
                base = mine.get(key, config[key])
                mine[key] = sorted(set(base) | set(arm.get(key, default)))
    config["merged_from"] = [c for c, *_ in loaded]
    atomic.atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    for index, name in ((1, "runs.csv"), (2, "decisions.csv"), (3, "timings.csv")):
        rows = [r for part in loaded for r in part[index]]
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            rows = [{k: _text(r.get(k)) for k in keys} for r in rows]
            write_csv(out / name, rows)
    write_report(out)


def _text(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def switch_spikes(
    rows, arm, reference, switch_examples, reference_rows=None, evaluations=SPIKE_EVALUATIONS
):
    """{seed: (jump, peak)} of `arm` against `reference` (kappa = 1, the same
    seeds, lr and decay; in `reference_rows` if given, else in `rows`):
    `jump` = test loss of `arm` minus that of `reference` at the first
    evaluation after `switch_examples` (where the window first grows),
    `peak` = the largest such difference over the `evaluations`
    evaluations after it."""
    mine = arm_curves(rows, arm)
    theirs = arm_curves(reference_rows if reference_rows is not None else rows, reference)
    out = {}
    for seed, points in mine.items():
        if seed not in theirs:
            continue
        ref = {p["examples"]: p["test_loss"] for p in theirs[seed]}
        after = [p for p in points if p["examples"] > switch_examples][:evaluations]
        diffs = [p["test_loss"] - ref[p["examples"]] for p in after]
        out[seed] = (diffs[0], max(diffs))
    return out


def spike_markdown(spikes, evaluations=SPIKE_EVALUATIONS):
    """Markdown: per arm ({arm: {seed: (jump, peak)}}) the jump one
    evaluation after its switch and the peak, per seed, and their medians."""
    lines = [
        f"| arm | per seed: jump one evaluation after the switch / peak over {evaluations} "
        "| jump: median (range) | peak: median (range) |",
        "|---|---|---|---|",
    ]
    for arm, per_seed in spikes.items():
        jumps = [j for j, _ in per_seed.values()]
        peaks = [p for _, p in per_seed.values()]
        cells = ", ".join(f"{s}: {j:+.3f} / {p:+.3f}" for s, (j, p) in sorted(per_seed.items()))
        lines.append(
            f"| {arm} | {cells} | {np.median(jumps):+.3f} ({min(jumps):+.3f} to "
            f"{max(jumps):+.3f}) | {np.median(peaks):+.3f} ({min(peaks):+.3f} to "
            f"{max(peaks):+.3f}) |"
        )
    return "\n".join(lines) + "\n"


def folder_spikes(workdir):
    """{arm: switch_spikes} of each piecewise arm of a study folder against
    the kappa = 1 arm of the same decay there, if it has one."""
    config, rows, _, _ = load(workdir)
    present = {r["arm"] for r in rows}
    refs = {"constant": REFERENCE, "cosine": COSINE, "wsd": WSD}
    out = {}
    for name, spec in config["arms"].items():
        reference = refs[spec.get("decay", "constant")]
        if name in present and reference in present and isinstance(spec["steps"], list):
            at = spec["steps"][0][0] * config["micro_batch_size"]
            out[name] = switch_spikes(rows, name, reference, at)
    return out


def write_report(workdir):
    """summary.md and table.json of a finished (or partial) study folder."""
    workdir = pathlib.Path(workdir)
    config, rows, _, _ = load(workdir)
    parts = []
    arms = {r["arm"] for r in rows}
    references = [
        r
        for r in (REFERENCE, COSINE, WSD)
        if r in arms and len({x["learning_rate"] for x in rows if x["arm"] == r}) == 1
    ]
    if references:
        tables = {}
        for reference in references:
            t, sigma, entries = controls_table(workdir, reference)
            parts += [f"## Controls against {reference} (test loss)\n"]
            parts += [table_markdown(t, sigma, entries, reference)]
            tables[reference] = {"T": t, "sigma": sigma, "arms": entries}
        atomic.atomic_write_text(workdir / "table.json", json.dumps(tables, indent=1) + "\n")
    if references:
        spikes = folder_spikes(workdir)
        if spikes:
            parts += ["## The switch: test loss minus kappa = 1's at the same examples\n"]
            parts += [spike_markdown(spikes)]
    parts += ["## Final validation loss\n", tuning_table(workdir)]
    reruns = rerun_difference(rows)
    if reruns:
        parts += ["## Reruns of one seed in one process: max |difference|\n"]
        parts += [f"* {arm}: {diff:.3g}" for arm, diff in reruns.items()] + [""]
    decisions = decision_summary(workdir)
    if decisions:
        parts += ["## AdaptiveSteps decisions\n", decisions]
    atomic.atomic_write_text(workdir / "summary.md", "\n".join(parts))


if __name__ == "__main__":
    # controls_report.py DIR (rewrite DIR's report) or OUT DIR1 DIR2 ... (merge)
    if len(sys.argv) > 2:
        merge(sys.argv[2:], sys.argv[1])
    else:
        write_report(sys.argv[1])
    print((pathlib.Path(sys.argv[1]) / "summary.md").read_text())
