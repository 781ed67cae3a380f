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
            f"over 12, {n12} and {m12}"
        )
    return "\n".join(lines) + "\n"


def report():
    parts_ = []
    for task in TASKS:
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
