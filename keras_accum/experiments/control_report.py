"""Issue #50's control, recomputed from its files: constant kappa = 2 and 4
at their own tuned decay, and the warmups at more than the borrowed lr,
against the tuned kappa = 1 of the decay studies (saved_configs/
schedule_control.py holds the protocol; docs/BATCH_SIZE_SCHEDULES.md the
tables).

Reads only committed folders: the decay study's (`decay`, `decay_mnist1d`:
kappa = 1 and the warmups at the borrowed lr) and this study's
(`control/<task>/...`). `python3 -m keras_accum.experiments.control_report`
prints every table.

Compute, three ways (the protocol's): serial updates, examples (16 x
gradient evaluations), and the wall-clock computed for `DEVICES` data-
parallel devices for every arm, kappa = 1 included (its micro-batch split
across them), at linear scaling: gradient evaluations x t / DEVICES, t the
median over the reference's seeds of its CPU seconds per micro-batch.
Communication, one all-reduce per update, is not counted.
"""

import importlib.util
import pathlib

import numpy as np

from keras_accum.experiments import controls_report as cr

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs/batch_size_schedules"
CONFIG = ROOT / "saved_configs/schedule_control.py"
TASKS = {"mnist1d_cnn": "mnist1d", "charlm": "charlm"}
BASELINE = {"mnist1d_cnn": DOCS / "decay_mnist1d", "charlm": DOCS / "decay"}
WSD, COSINE = cr.WSD, cr.COSINE
MICRO_BATCH = 16
BUDGET = 3072  # micro-batches per run


def protocol():
    """The config module's PROTOCOL, TUNED and grids (read, not run)."""
    spec = importlib.util.spec_from_file_location("schedule_control", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder(task, part):
    return DOCS / "control" / TASKS[task] / part


def parts(task):
    """This study's folders of `task` that hold runs, in the order run."""
    base = DOCS / "control" / TASKS[task]
    names = (
        "control",
        "warmups",
        "warmups_edge",
        "warmups_edge_2",
        "warmups_2",
        "control_cosine",
        "spike_reference",
    )
    return [base / n for n in names if (base / n / "config.json").exists()]


def tuning(task, decay="wsd"):
    """{arm: {lr: [final val_loss per seed]}} of the kappa = 2 and 4 tuning
    runs of `decay`."""
    out = {}
    base = DOCS / "control" / TASKS[task]
    for path in sorted(base.glob("tune*")):  # tune, tune_edge (the edge rule), tune_cosine
        _, rows, _, _ = cr.load(path)
        for (arm, lr, _, rerun), points in cr.curves(rows).items():
            if arm.endswith(f" {decay}") and not rerun:
                out.setdefault(arm, {}).setdefault(lr, []).append(points[-1]["val_loss"])
    return out


def choose(finals, grid):
    """(chosen lr, edge): the lowest mean final val_loss, and whether it is
    at an edge of the points run (the protocol then adds one beyond)."""
    best = min(finals, key=lambda lr: np.mean(finals[lr]))
    ran = sorted(finals)
    return best, best in (ran[0], ran[-1])


def tuning_markdown(task, decay="wsd"):
    module = protocol()
    grid = module.MNIST1D_GRID if task == "mnist1d_cnn" else module.CHARLM_GRID
    lines = [
        "| arm | base lr | seeds | final val_loss | |",
        "|---|---|---|---|---|",
    ]
    for arm, finals in sorted(tuning(task, decay).items()):
        best, _ = choose(finals, grid)
        for lr in sorted(finals):
            notes = []
            if lr == best:
                notes.append("chosen")
            if not any(np.isclose(lr, g) for g in grid):
                notes.append("added (edge rule)")
            lines.append(
                f"| {arm} | {lr:g} | {len(finals[lr])} | {cr._mean_std(finals[lr], 4)} | "
                f"{', '.join(notes)} |"
            )
    return "\n".join(lines) + "\n"


def seconds_per_micro_batch(task, reference=WSD):
    """Median over the reference's seeds of its CPU seconds per micro-batch."""
    _, rows, _, timings = cr.load(BASELINE[task])
    got = [t["cpu_seconds"] / BUDGET for t in timings if t["arm"] == reference and t["rerun"] == 0]
    return float(np.median(got))


def _status(task, arm, baseline_arms):
    if arm in baseline_arms:
        return "earlier study"
    return "planned" if arm in protocol().PROTOCOL["planned"][task] else "added"


def entries(task, reference=WSD):
    """(T, sigma, [arm_summary with `status`, `devices_seconds`]) of the
    reference, this study's arms of its decay, and the decay study's."""
    decay = reference.split()[-1]
    base = BASELINE[task]
    base_arms = list(cr.load(base)[0]["arms"])
    folders = [base, *parts(task)]
    order = [reference]
    for path in parts(task):
        order += [a for a in cr.load(path)[0]["arms"] if f" {decay}" in a]
    if decay == "wsd":
        order += [a for a in base_arms if a.startswith(("1->2->4", "1->4 at 512 ramp"))]
    t, sigma, found = cr.combined_table(folders, reference, order)
    per = seconds_per_micro_batch(task) / protocol().PROTOCOL["devices"]
    for e in found:
        e["status"] = _status(task, e["arm"], base_arms)
        e["devices_seconds"] = [g * per for g in e["gradient_evaluations"]]
        e["first_devices_seconds"] = [
            None if g is None else g * per for g in e["first_gradient_evaluations"]
        ]
    return t, sigma, found


def _mean(values, digits=0):
    got = [v for v in values if v is not None]
    return f"{np.mean(got):.{digits}f}" if got else "-"


def _wall(values):
    got = [v for v in values if v is not None]
    return f"{np.mean(got):.3g}" if got else "-"


def table_markdown(task, reference=WSD):
    t, sigma, found = entries(task, reference)
    devices = protocol().PROTOCOL["devices"]
    lines = [
        f"T = {t:.4f}, sigma = {sigma:.4f} ({reference}, 8 seeds); reach: first test loss "
        f"<= T + sigma = {t + sigma:.4f}. At first reach: mean over the seeds that reach. "
        f"Wall-clock: computed for {devices} devices, communication not counted.",
        "",
        f"| arm | status | base lr | seeds | final test loss | diff to {reference} [95% CI] "
        "| reach | updates to reach | examples to reach | updates | examples | wall s to "
        f"reach, {devices} devices | wall s, {devices} devices |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in found:
        diff, low, high = e["welch"]
        ci = "-" if e["arm"] == reference else f"{diff:+.4f} [{low:+.4f}, {high:+.4f}]"
        reached = sum(v is not None for v in e["first_updates"])
        examples = [None if g is None else g * MICRO_BATCH for g in e["first_gradient_evaluations"]]
        lines.append(
            f"| {e['arm']} | {e['status']} | {e['learning_rate']:g} | {len(e['seeds'])} | "
            f"{cr._mean_std(e['final'], 4)} | {ci} | {reached} of {len(e['seeds'])} | "
            f"{_mean(e['first_updates'])} | {_mean(examples)} | "
            f"{np.mean(e['updates']):.0f} | {np.mean(e['gradient_evaluations']) * MICRO_BATCH:.0f}"
            f" | {_wall(e['first_devices_seconds'])} | {_wall(e['devices_seconds'])} |"
        )
    return "\n".join(lines) + "\n"


def spike_reference(task, lr):
    """(rows, arm) of kappa = 1 at base lr `lr` on the same seeds and
    stream, the same run as a warmup at `lr` up to its switch: the decay
    study's WSD arm at its lr, this study's `spike_reference` runs, or on
    the char LM at 3e-3 the controls' constant kappa = 1 (WSD is constant
    until micro-step 2458, past every window); None if none was run."""
    _, rows, _, _ = cr.load(BASELINE[task])
    if np.isclose(lr, cr.arm_curves(rows, WSD)[0][0]["learning_rate"]):
        return rows, WSD
    path = folder(task, "spike_reference")
    if (path / "config.json").exists():
        _, rows, _, _ = cr.load(path)
        if any(r["arm"] == f"kappa=1 wsd lr {lr:g}" for r in rows):
            return rows, f"kappa=1 wsd lr {lr:g}"
    if task == "charlm" and np.isclose(lr, 3e-3):
        return cr.load(DOCS / "controls")[1], cr.REFERENCE
    return None


def spikes(task, evaluations=None):
    """{arm: {seed: (jump, peak)}} of this study's piecewise arms against
    kappa = 1 at their own lr (`spike_reference`), over the protocol's
    window (or `evaluations`)."""
    window = evaluations or protocol().PROTOCOL["spike_window_evaluations"]
    out = {}
    for path in parts(task):
        config, rows, _, _ = cr.load(path)
        present = {r["arm"] for r in rows}
        for name, spec in config["arms"].items():
            if name in present and isinstance(spec["steps"], list):
                found = spike_reference(task, spec["learning_rates"][0])
                if found is None:
                    continue
                at = spec["steps"][0][0] * MICRO_BATCH
                out[name] = cr.switch_spikes(rows, name, found[1], at, found[0], window)
    return out


def spike_counts(task, evaluations=None):
    """{arm: (seeds over the threshold, over the lower threshold, seeds)}."""
    p = protocol().PROTOCOL
    high, low = p["spike_threshold"], p["spike_threshold_also_reported"]
    return {
        arm: (
            sum(peak > high for _, peak in s.values()),
            sum(peak > low for _, peak in s.values()),
            len(s),
        )
        for arm, s in spikes(task, evaluations).items()
    }


WARMUPS = ("1->2->4 at 512, 1024 wsd", "1->4 at 512 ramp wsd")


def warmup_val(task):
    """{warmup: {lr: [final val_loss per seed]}} of the two warmups with WSD
    at every lr run (seeds 0-7: the validation split is held out of
    training, so reading it here is tuning, not testing)."""
    out = {}
    for path in [BASELINE[task], *parts(task)]:
        _, rows, _, _ = cr.load(path)
        for (arm, lr, _, rerun), points in cr.curves(rows).items():
            kind = next((w for w in WARMUPS if arm == w or arm.startswith(w + " lr ")), None)
            if kind and not rerun:
                out.setdefault(kind, {}).setdefault(lr, []).append(points[-1]["val_loss"])
    return out


def warmup_val_markdown(task):
    lines = ["| warmup | base lr | seeds | final val_loss | |", "|---|---|---|---|---|"]
    for kind, finals in warmup_val(task).items():
        best = min(finals, key=lambda lr: np.mean(finals[lr]))
        for lr in sorted(finals):
            note = "lowest" if lr == best else ""
            lines.append(
                f"| {kind} | {lr:g} | {len(finals[lr])} | {cr._mean_std(finals[lr], 4)} | {note} |"
            )
    return "\n".join(lines) + "\n"


def versus(task, decay="wsd"):
    """{(warmup, constant): Welch (diff, low, high)} of each warmup of
    `decay` (this study's and the decay study's) against constant kappa =
    2 and 4 with the same decay at their own tuned lr: final test loss,
    warmup minus constant."""
    _, _, found = entries(task, WSD if decay == "wsd" else COSINE)
    by = {e["arm"]: e for e in found}
    out = {}
    for warm in [a for a in by if a.startswith("1->")]:
        for k in (2, 4):
            const = by.get(f"kappa={k} {decay}")
            if const:
                out[(warm, const["arm"])] = cr.welch(by[warm]["final"], const["final"])
    return out


def versus_markdown(task):
    lines = [
        "| warmup | against | final test loss, warmup minus constant [95% CI] |",
        "|---|---|---|",
    ]
    for (warm, const), (d, lo, hi) in versus(task).items():
        lines.append(f"| {warm} | {const} | {d:+.4f} [{lo:+.4f}, {hi:+.4f}] |")
    return "\n".join(lines) + "\n"


def spike_section(task):
    """The spike table over the protocol's window and the counts over it
    and over 12 evaluations (to micro-step 1280, past 1 -> 2 -> 4's second
    switch; that window was added after the protocol)."""
    p = protocol().PROTOCOL
    window = p["spike_window_evaluations"]
    lines = [cr.spike_markdown(spikes(task), window)]
    wide = spike_counts(task, 12)
    for arm, (n, m, s) in spike_counts(task).items():
        n12, m12, _ = wide[arm]
        lines.append(
            f"* {arm}: over {window} evaluations {n} of {s} seeds peak above "
            f"{p['spike_threshold']}, {m} of {s} above {p['spike_threshold_also_reported']}; "
            f"over 12, {n12} and {m12}; before the switch the arm and its reference differ "
            f"by at most {before_switch(task, arm):.1e} in test loss"
        )
    unreferenced = [a for a in warmup_arms(task) if a not in wide]
    if unreferenced:
        lines.append(f"* no kappa = 1 run at the lr of {'; '.join(unreferenced)}: not counted")
    return "\n".join(lines) + "\n"


def warmup_arms(task):
    """This study's piecewise arms of `task`."""
    return [
        name
        for path in parts(task)
        for name, spec in cr.load(path)[0]["arms"].items()
        if isinstance(spec["steps"], list)
    ]


def before_switch(task, arm):
    """max |test loss of `arm` - its spike reference's| over the
    evaluations up to its first switch, every seed (0: the same run)."""
    for path in parts(task):
        config, rows, _, _ = cr.load(path)
        if arm in config["arms"]:
            spec = config["arms"][arm]
            break
    ref_rows, ref = spike_reference(task, spec["learning_rates"][0])
    at = spec["steps"][0][0] * MICRO_BATCH
    theirs = cr.arm_curves(ref_rows, ref)
    diffs = [
        abs(p["test_loss"] - q["test_loss"])
        for seed, points in cr.arm_curves(rows, arm).items()
        for p, q in zip(points, theirs[seed])
        if p["examples"] <= at
    ]
    return max(diffs)


NAMES = {"1->2->4 at 512, 1024 wsd": "1 -> 2 -> 4", "1->4 at 512 ramp wsd": "the ramped 1 -> 4"}


def _ci(interval):
    d, lo, hi = interval
    return f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]"


def _reached(e):
    return sum(v is not None for v in e["first_updates"])


def _first(e, key):
    got = [v for v in e[key] if v is not None]
    return float(np.mean(got)) if got else None


def _lr(value):
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def best_warmup_lrs(task):
    """{warmup: lr} with the lowest mean final val_loss over the lrs run."""
    return {k: min(f, key=lambda lr: np.mean(f[lr])) for k, f in warmup_val(task).items()}


def _arm_at(by, kind, lr, base_lr):
    return by[kind] if np.isclose(lr, base_lr) else by[f"{kind} lr {lr:g}"]


def findings(task):
    """The numbers the prose quotes, per task: a dict."""
    t, sigma, found = entries(task)
    by = {e["arm"]: e for e in found}
    ref, k2, k4 = by[WSD], by["kappa=2 wsd"], by["kappa=4 wsd"]
    base_lr = ref["learning_rate"]
    out = {"T": t, "sigma": sigma, "ref": ref, "k2": k2, "k4": k4, "warmups": {}}
    for kind, lr in best_warmup_lrs(task).items():
        e = _arm_at(by, kind, lr, base_lr)
        borrowed = by[kind]
        out["warmups"][kind] = {
            "lr": lr,
            "entry": e,
            "vs_k4": cr.welch(e["final"], k4["final"]),
            "vs_k2": cr.welch(e["final"], k2["final"]),
            "borrowed": borrowed,
            "borrowed_vs_k4": cr.welch(borrowed["final"], k4["final"]),
        }
    return out


def verdict(intervals):
    """'lower', 'higher' or 'not told apart' of warmup-minus-constant
    intervals: lower only if every interval lies below 0."""
    if all(hi < 0 for _, _, hi in intervals):
        return "lower"
    if all(lo > 0 for _, lo, _ in intervals):
        return "higher"
    return "not told apart"


VERDICT = {
    "lower": "the warmups end lower than the constant larger batch",
    "higher": "the warmups end higher than the constant larger batch",
    "not told apart": "no warmup's final loss is told apart from the constant larger "
    "batch's (every interval includes 0)",
}


def _has_cosine(task):
    return any("cosine" in a for p in parts(task) for a in cr.load(p)[0]["arms"])


def answer(task):
    """One paragraph: does a warmup beat the constant larger batch at its
    own tuned decay on `task`, with the numbers."""
    f = findings(task)
    label = {"mnist1d_cnn": "On the MNIST-1D CNN", "charlm": "On the char LM"}[task]
    k2, k4, ref = f["k2"], f["k4"], f["ref"]
    parts_ = [
        f"{label}, constant kappa = 2 and 4 with WSD, each tuned on the validation split, "
        f"pick base lrs {_lr(k2['learning_rate'])} and {_lr(k4['learning_rate'])} (kappa = 1: "
        f"{_lr(ref['learning_rate'])}) and end {_ci(k2['welch'])} and {_ci(k4['welch'])} from "
        f"kappa = 1 (8 seeds), reaching its T + sigma in {_reached(k2)} and {_reached(k4)} of 8 "
        f"seeds (kappa = 1: {_reached(ref)})."
    ]
    intervals = []
    for kind, w in f["warmups"].items():
        e = w["entry"]
        intervals.append(w["vs_k4"])
        u, x = _first(e, "first_updates"), _first(e, "first_gradient_evaluations")
        parts_.append(
            f"{NAMES[kind][0].upper() + NAMES[kind][1:]} at its best lr on validation "
            f"({_lr(w['lr'])}) ends {_ci(w['vs_k4'])} from kappa = 4 (warmup minus constant) and "
            f"reaches in {_reached(e)} of 8"
            + (f" after {u:.0f} updates and {x * MICRO_BATCH:.0f} examples" if u else "")
            + "."
        )
    u4, x4 = _first(k4, "first_updates"), _first(k4, "first_gradient_evaluations")
    vs2 = " and ".join(_ci(w["vs_k2"]) for w in f["warmups"].values())
    parts_.append(
        (
            f"Kappa = 4 reaches after {u4:.0f} updates and {x4 * MICRO_BATCH:.0f} examples."
            if u4
            else "Kappa = 4 never reaches it."
        )
        + f" Against kappa = 2 the same warmups end {vs2}."
        + f" So, against kappa = 4: {VERDICT[verdict(intervals)]}."
    )
    per = " and ".join(_lr(4 * w["lr"]) for w in f["warmups"].values())
    made = " and ".join(f"{np.mean(w['entry']['updates']):.0f}" for w in f["warmups"].values())
    parts_.append(
        f"Per update, kappa = 4's tuned lr is {_lr(4 * k4['learning_rate'])}; the warmups' "
        f"after their last switch {per}. The warmups make {made} serial updates (all-reduces) "
        f"in all, kappa = 4 {np.mean(k4['updates']):.0f}, kappa = 2 "
        f"{np.mean(k2['updates']):.0f}, kappa = 1 {np.mean(ref['updates']):.0f}; every arm "
        "trains on the same examples."
    )
    cos = {e["arm"]: e for e in entries(task, COSINE)[2]} if _has_cosine(task) else {}
    if "kappa=4 cosine" in cos:
        c2, c4 = cos["kappa=2 cosine"], cos["kappa=4 cosine"]
        parts_.append(
            f"With the cosine decay (no warmup ran with it in this study), kappa = 2 and 4 at "
            f"their own tuned lrs ({_lr(c2['learning_rate'])}, {_lr(c4['learning_rate'])}) end "
            f"{_ci(c2['welch'])} and {_ci(c4['welch'])} from kappa = 1 with cosine and reach "
            f"its T + sigma in {_reached(c2)} and {_reached(c4)} of 8 seeds."
        )
    return " ".join(parts_)


def borrowed_gap(task, other):
    """(gap, standard errors): how far kappa = 1 WSD's tuned lr's mean final
    val_loss lies below `other`'s in the decay study's tuning (3 seeds)."""
    _, rows, _, _ = cr.load(BASELINE[task] / "tune")
    finals = {}
    for (arm, lr, _, rerun), points in cr.curves(rows).items():
        if arm == WSD and not rerun:
            finals.setdefault(lr, []).append(points[-1]["val_loss"])
    best = min(finals, key=lambda lr: np.mean(finals[lr]))
    a, b = np.array(finals[best]), np.array(finals[min(finals, key=lambda x: abs(x - other))])
    gap = b.mean() - a.mean()
    se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return float(gap), float(gap / se)


def wall_clock(task):
    """(seconds per micro-batch, 4-device seconds to the end of 3072
    micro-batches, {arm: 4-device seconds to reach})."""
    t = seconds_per_micro_batch(task)
    devices = protocol().PROTOCOL["devices"]
    _, _, found = entries(task)
    reach = {e["arm"]: _first(e, "first_devices_seconds") for e in found}
    return t, BUDGET * t / devices, reach


def reach_test(a, b):
    """Fisher's exact two-sided p of the reach counts of entries a and b."""
    from scipy import stats

    ra, rb = _reached(a), _reached(b)
    table = [[ra, len(a["seeds"]) - ra], [rb, len(b["seeds"]) - rb]]
    return float(stats.fisher_exact(table)[1])


def short_answer(task):
    """The README's and the guide's sentence for `task`: does a warmup
    beat constant kappa = 4 at its own tuned decay."""
    f = findings(task)
    k4 = f["k4"]
    label = {"mnist1d_cnn": "On MNIST-1D", "charlm": "On the char LM"}[task]
    warm = list(f["warmups"].items())
    ends = " and ".join(f"{_ci(w['vs_k4'])} ({NAMES[k]})" for k, w in warm)
    reach = " and ".join(str(_reached(w["entry"])) for _, w in warm)
    examples = " and ".join(
        f"{_first(w['entry'], 'first_gradient_evaluations') * MICRO_BATCH:.0f}"
        if _reached(w["entry"])
        else "-"
        for _, w in warm
    )
    x4 = _first(k4, "first_gradient_evaluations")
    pvalues = " and ".join(f"{reach_test(w['entry'], k4):.2f}" for _, w in warm)
    told = VERDICT[verdict([w["vs_k4"] for _, w in warm])]
    told = told[0].upper() + told[1:]
    vs2 = " and ".join(_ci(w["vs_k2"]) for _, w in warm)
    counts = f"Fisher's exact p of their reach counts against kappa = 4's: {pvalues}"
    return (
        f"{label}, constant kappa = 4 with WSD at its own tuned lr "
        f"({_lr(k4['learning_rate'])}) ends {_ci(k4['welch'])} from kappa = 1 and reaches its "
        f"T + sigma in {_reached(k4)} of 8 seeds; the warmups at their best lr on validation "
        f"end {ends} from kappa = 4 (against kappa = 2 at its own tuned lr: {vs2}) and reach "
        f"in {reach} of 8, with {examples} examples to reach "
        + ("(kappa = 4 never reaches)" if x4 is None else f"against its {x4 * MICRO_BATCH:.0f}")
        + f". {told}; {counts}."
    )


def control_paragraph(link="docs/BATCH_SIZE_SCHEDULES.md"):
    """The README's and docs/guides/schedules.md's paragraph: does a
    warmup beat the constant larger batch at its own tuned decay, per task
    (a task whose control has not run says so)."""
    out = [
        "**Does a warmup beat simply training at the larger batch?** Against constant "
        "kappa = 4 with its own tuned decay (issue #50; each lr tuned on the validation "
        "split, then 8 seeds):"
    ]
    for task in TASKS:
        try:
            out.append(short_answer(task))
        except KeyError:  # the control's 8 seeds were not run
            out.append(
                f"On {'the char LM' if task == 'charlm' else 'MNIST-1D'} the control's "
                "8-seed runs were not run (see the study)."
            )
    out.append(
        "Both save serial updates (all-reduces) over kappa = 1; at equal devices, with "
        "communication not counted, every arm of the same examples takes the same computed "
        f"wall-clock. [The study]({link}#the-control-the-constant-larger-batch-at-its-own-"
        "tuned-decay-issue-50)."
    )
    return " ".join(out)


TITLE = "## The control: the constant larger batch at its own tuned decay (issue #50)"
INTRO = """Against a tuned decayed kappa = 1 no batch-size warmup ended lower (the
sections above). The question left: does starting small buy anything over
training at the larger batch from the first step, with that batch's own
tuned decay? And the warmups' lr was borrowed from kappa = 1 (6e-3 on the
char LM, 8e-3 on MNIST-1D), where it had beaten the next candidate by
{gap_charlm:.2f} (char LM, 3e-3) and {gap_mnist:.2f} (MNIST-1D, 1.13e-2)
standard errors of the 3-seed tuning: not a tuned lr for them.

**Protocol** (`PROTOCOL` in saved_configs/schedule_control.py, committed
before any of these runs). The decay studies' tasks, budget (3072
micro-batches of 16), evaluation grid (every 1024 examples, 48
evaluations), validation split, InvariantAdam `"fixed_beta_1"`. Constant
kappa = 2 and kappa = 4 with WSD and with cosine, each tuned on
at least 4 base lrs x 3 seeds (100-102) on the final validation loss, the
lowest mean chosen (a winner at the grid's edge adds one point beyond it),
then 8 seeds (0-7) at the chosen lr. The warmups 1 -> 2 -> 4 (at 512,
1024) and 1 -> 4 ramped (128 micro-steps) with WSD at two more lrs, 8
seeds each. Reach: the first test loss <= T + sigma of kappa = 1 with the
same decay (8 seeds). Spike: the peak of the test loss minus kappa = 1's
at the same seed, lr and examples over the 4 evaluations after the first
switch, above 0.1 (0.05 reported beside it). Every arm is marked
*planned* (in the committed protocol), *added* (run after seeing earlier
results: each is named with its reason in the config) or *earlier study*.

**Compute, three ways.** Serial updates; examples; and the wall-clock
computed for 4 data-parallel devices for every arm, kappa = 1 included
(its micro-batch of 16 split 4 ways): at linear scaling a window of kappa
micro-batches takes kappa x t / 4, so every arm's wall-clock is its
examples / 16 x t / 4, t the CPU seconds of one micro-batch measured on
kappa = 1 ({t_mnist:.2f} ms on MNIST-1D, {t_charlm:.1f} ms on the char
LM). Communication is not counted: one all-reduce per update, so the
updates column is also the count of all-reduces, where the warmups and
the larger constant batch save. At equal devices every arm of 3072
micro-batches takes the same time to its end ({w_mnist:.3f} s on
MNIST-1D, {w_charlm:.1f} s on the char LM); to the reach, its examples to
reach decide. "x% fewer updates" is mostly arithmetic under a decay: an
arm reaches, if at all, near the end of its own run, and a run at kappa =
4 has a quarter of the updates; the reach rate and the examples to reach
carry the information.
"""


def _task_section(task, title):
    out = [f"### {title}\n", answer(task) + "\n", "**Tuning** (final validation loss):\n"]
    out += [tuning_markdown(task)]
    cosine_arms = any("cosine" in a for p in parts(task) for a in cr.load(p)[0]["arms"])
    if tuning(task, "cosine"):
        out += [tuning_markdown(task, "cosine")]
    out += ["**Against kappa = 1 with WSD** (test loss):\n", table_markdown(task)]
    if cosine_arms:
        out += ["**Against kappa = 1 with cosine** (test loss):\n", table_markdown(task, COSINE)]
    out += ["**The warmups against the constant larger batch** (WSD):\n", versus_markdown(task)]
    out += ["**The warmups' lr** (final validation loss, seeds 0-7):\n", warmup_val_markdown(task)]
    out += ["**The spike** (against kappa = 1 at the warmup's own lr):\n", spike_section(task)]
    return out


def ledger():
    """(planned arms run, planned arms not run, added arms run, [(folder,
    runs, minutes)]) over both tasks."""
    import json

    planned = protocol().PROTOCOL["planned"]
    ran, added, cost = [], [], []
    for task in TASKS:
        base = DOCS / "control" / TASKS[task]
        for path in sorted(base.glob("*/summary.json")):
            summary = json.loads(path.read_text())
            cost.append((f"{TASKS[task]}/{path.parent.name}", summary["runs"], summary["seconds"]))
        for path in parts(task):
            for arm in {r["arm"] for r in cr.load(path)[1]}:
                (ran if arm in planned[task] else added).append(f"{TASKS[task]}: {arm}")
    missing = [f"{TASKS[t]}: {a}" for t in TASKS for a in planned[t]]
    missing = [a for a in missing if a not in ran]
    return sorted(ran), missing, sorted(added), cost


def ledger_markdown():
    ran, missing, added, cost = ledger()
    runs = sum(n for _, n, _ in cost)
    minutes = sum(s for _, _, s in cost) / 60
    return "\n".join(
        [
            "**Planned, added, not run.** Planned and run (8 seeds each): "
            + "; ".join(ran)
            + ". Added after seeing earlier results (reasons in saved_configs/"
            "schedule_control.py): "
            + ("; ".join(added) or "none")
            + ". Planned and not run (time): "
            + ("; ".join(missing) or "none")
            + ".",
            "",
            f"**Cost.** One shared core (taskset -c 1), TensorFlow one thread: {runs} runs "
            f"(tuning included), {minutes:.0f} min of process wall time with the "
            "evaluations, summed (some processes shared the core), per folder "
            + ", ".join(f"{name} {n} runs {sec / 60:.1f} min" for name, n, sec in cost)
            + ". Raw files: docs/batch_size_schedules/control/.",
            "",
        ]
    )


def section_markdown(extra=""):
    """The docs' section, numbers and tables from the committed files;
    `extra`: the hand-written paragraphs after the tables."""
    t_m, w_m, _ = wall_clock("mnist1d_cnn")
    t_c = seconds_per_micro_batch("charlm")
    out = [
        TITLE + "\n",
        INTRO.format(
            gap_charlm=borrowed_gap("charlm", 3e-3)[1],
            gap_mnist=borrowed_gap("mnist1d_cnn", 1.13e-2)[1],
            t_mnist=t_m * 1000,
            t_charlm=t_c * 1000,
            w_mnist=w_m,
            w_charlm=BUDGET * t_c / protocol().PROTOCOL["devices"],
        ),
    ]
    for task, title in (("mnist1d_cnn", "MNIST-1D"), ("charlm", "The char LM")):
        if parts(task) or tuning(task):
            out += (
                _task_section(task, title)
                if parts(task)
                else [
                    f"### {title}\n",
                    "**Tuning** (final validation loss):\n",
                    tuning_markdown(task),
                ]
            )
    out += [ledger_markdown()]
    return "\n".join(out) + extra


def report():
    parts_ = []
    for task in TASKS:
        if parts(task):
            parts_ += [answer(task), ""]
        parts_ += [f"# {task}\n", "## Tuning (final val_loss)\n", tuning_markdown(task)]
        if tuning(task, "cosine"):
            parts_ += [tuning_markdown(task, "cosine")]
        if parts(task):
            parts_ += ["## Against kappa=1 wsd\n", table_markdown(task)]
            cosine = [p for p in parts(task) if any("cosine" in a for a in cr.load(p)[0]["arms"])]
            if cosine:
                parts_ += ["## Against kappa=1 cosine\n", table_markdown(task, COSINE)]
            parts_ += ["## Warmups against the constant larger batch\n", versus_markdown(task)]
            parts_ += ["## The warmups' lr (final val_loss)\n", warmup_val_markdown(task)]
            parts_ += ["## Spikes\n", spike_section(task)]
    return "\n".join(parts_)


if __name__ == "__main__":
    print(report())
