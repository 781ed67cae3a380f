"""Batch-size warmups against a decayed kappa = 1 (issue #42): the WSD
schedule by hand, the config's checks, and every number of
docs/BATCH_SIZE_SCHEDULES.md's "against the recipe people use" section
recomputed from the committed files (no training, no network)."""

import csv
import gzip
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from keras_accum.experiments import config as cfg
from keras_accum.experiments import controls_report, experiment, schedules_controls

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECAY = ROOT / "docs/batch_size_schedules/decay"
CONTROLS = ROOT / "docs/batch_size_schedules/controls"
DOC = ROOT / "docs/BATCH_SIZE_SCHEDULES.md"
CONFIG = ROOT / "saved_configs/schedule_cosine.py"


def _doc_words():
    return " ".join(DOC.read_text().split())


def test_wsd_is_constant_then_linear_to_zero():
    peak = tf.Variable(2.0)
    wsd = schedules_controls.WarmupStableDecay(peak, 100, decay=0.2)
    got = [float(wsd(t)) for t in (0, 79, 80, 90, 100, 150)]
    assert got == pytest.approx([2.0, 2.0, 2.0, 1.0, 0.0, 0.0])
    assert wsd.get_config() == {"peak": 2.0, "total": 100, "decay": 0.2}


def test_switch_lr_ramp_takes_the_per_update_lr_from_1x_to_kx():
    inner = schedules_controls.Constant(tf.Variable(1.0))
    ramp = schedules_controls.SwitchLrRamp(inner, at=512, ramp=128, ratio=4)
    got = [float(ramp(t)) for t in (0, 511, 512, 576, 640, 1000)]
    assert got == pytest.approx([1.0, 1.0, 0.25, 0.625, 1.0, 1.0])


def test_config_variants_resolve_and_bad_arms_are_refused():
    for variant in ("tune", "cosine", "spike", "lr_ramp", "smoke"):
        schedules_controls.resolve_config(experiment.load_config_file(CONFIG, variant))
    base = experiment.load_config_file(CONFIG, "smoke")
    for arm, message in (
        ({"steps": 1, "decay": "linear"}, "`decay` must be one of"),
        ({"steps": 4, "ramp": 32}, "`ramp` is an int, with a piecewise `steps` only"),
        ({"steps": [[16], [2, 4]], "lr_ramp": 32}, "`lr_ramp` needs a piecewise `steps` 1 -> k"),
    ):
        with pytest.raises(cfg.ConfigError, match=message):
            schedules_controls.resolve_config({**base, "arms": {"x": arm}})


def test_tuned_learning_rates_and_decay_recompute_from_the_validation_losses():
    """The config's lrs and decay are the best final val_loss of the
    committed tuning runs (6 lrs x 3 seeds per decay), and the docs'
    tuning table is the one the report computes."""
    module = experiment.load_config_file(CONFIG, "cosine")
    tune = DECAY / "tune"
    best = {d: controls_report.best_learning_rate(tune, f"kappa=1 {d}") for d in ("cosine", "wsd")}
    assert module["learning_rates"] == [best["wsd"]]
    assert module["arms"]["kappa=1 cosine"]["learning_rates"] == [best["cosine"]]
    table = controls_report.tuning_table(tune)
    rows = table.splitlines()[2:]
    assert len(rows) == 12 and all("| 3 |" in r for r in rows)
    doc = DOC.read_text()
    for row in rows:
        assert row in doc, row


def _finals(arm):
    finals = {}
    with gzip.open(DECAY / "runs.csv.gz", "rt", newline="") as f:
        for row in csv.DictReader(f):
            if row["arm"] == arm and row["rerun"] == "0":
                finals[int(row["seed"])] = float(row["test_loss"])  # the last row wins
    return finals


def test_docs_decay_tables_recompute_from_the_committed_files():
    """Every row of both tables (against WSD and cosine kappa = 1) is in
    the docs, and the threshold line from csv and numpy alone."""
    doc = DOC.read_text()
    for reference in ("kappa=1 wsd", "kappa=1 cosine"):
        t, sigma, entries = controls_report.controls_table(DECAY, reference)
        text = controls_report.table_markdown(t, sigma, entries, reference)
        rows = [x for x in text.splitlines() if x.startswith("| ") and "| arm |" not in x]
        assert len(rows) >= 2 * len(entries)
        missing = [x for x in rows if x not in doc]
        assert not missing, missing
    finals = list(_finals("kappa=1 wsd").values())
    assert len(finals) == 8
    line = (
        f"T = {np.mean(finals):.4f} (mean final test loss of kappa=1 wsd), "
        f"sigma = {np.std(finals, ddof=1):.4f}"
    )
    assert line in doc


def test_docs_spike_tables_recompute_from_the_committed_files():
    """The jump one evaluation after the switch, per seed, before (no ramp)
    and after (the ramp): at the tuned lr with WSD (one folder), and at the
    controls' constant 3e-3 against the controls' kappa = 1."""
    doc = DOC.read_text()
    text = controls_report.spike_markdown(controls_report.folder_spikes(DECAY))
    constant = controls_report.read_csv(CONTROLS / "runs.csv")
    ramp = controls_report.read_csv(DECAY / "spike/runs.csv")
    spikes = {
        "1->4 at 512": controls_report.switch_spikes(constant, "1->4 at 512", "kappa=1", 8192),
        "1->4 at 512 ramp": controls_report.switch_spikes(
            ramp, "1->4 at 512 ramp", "kappa=1", 8192, reference_rows=constant
        ),
    }
    text += controls_report.spike_markdown(spikes)
    lr_ramp = "1->4 at 512 lr ramp wsd"
    spikes = {
        lr_ramp: controls_report.switch_spikes(
            controls_report.read_csv(DECAY / "lr_ramp/runs.csv"),
            lr_ramp,
            "kappa=1 wsd",
            8192,
            reference_rows=controls_report.read_csv(DECAY / "runs.csv"),
        )
    }
    text += controls_report.spike_markdown(spikes)
    # Over 12 evaluations, with the 256 ramp run afterwards.
    main = controls_report.read_csv(DECAY / "runs.csv")
    arms = ("1->4 at 512 wsd", "1->2->4 at 512, 1024 wsd", "1->4 at 512 ramp wsd")
    spikes = {
        a: controls_report.switch_spikes(main, a, "kappa=1 wsd", 8192, evaluations=12) for a in arms
    }
    ramp256 = "1->4 at 512 ramp 256 wsd"
    spikes[ramp256] = controls_report.switch_spikes(
        controls_report.read_csv(DECAY / "ramp256/runs.csv"),
        ramp256,
        "kappa=1 wsd",
        8192,
        reference_rows=main,
        evaluations=12,
    )
    text += controls_report.spike_markdown(spikes, 12)
    smooth = sum(p < 0.1 for _, p in spikes[ramp256].values())
    assert f"256 micro-steps is smooth at 6e-3 in {smooth} of 8." in _doc_words()
    rows = [x for x in text.splitlines() if x.startswith("| ") and "| arm |" not in x]
    assert len(rows) >= 10
    missing = [x for x in rows if x not in doc]
    assert not missing, missing


def _readme_words():
    return " ".join((ROOT / "README.md").read_text().split())


def test_short_answer_and_readme_numbers_recompute_from_the_committed_files():
    """The headline of the docs and the README: final-loss intervals, seeds
    reaching, updates and examples at first reach against WSD kappa = 1,
    and the spike with and without the ramp."""
    t, sigma, entries = controls_report.controls_table(DECAY, "kappa=1 wsd")
    arm = {e["arm"]: e for e in entries}

    def mean(e, key):
        return np.mean([v for v in e[key] if v is not None])

    def ci(e):
        diff, low, high = e["welch"]
        return f"{diff:+.4f} [{low:+.4f}, {high:+.4f}]"

    def reached(e):
        return sum(v is not None for v in e["first_updates"])

    ref = arm["kappa=1 wsd"]
    steps = arm["1->2->4 at 512, 1024 wsd"]
    four = arm["1->4 at 512 wsd"]
    adaptive = arm["adaptive preconditioned wsd"]
    ref_updates = mean(ref, "first_updates")
    saving = 1 - mean(steps, "first_updates") / ref_updates
    doc = (
        f"ends {ci(steps)} from it and reaches its final test loss plus one seed std in "
        f"{reached(steps)} of 8 seeds, with {saving:.0%} fewer serial updates "
        f"({mean(steps, 'first_updates'):.0f} against {ref_updates:.0f}) and as many examples "
        f"({mean(steps, 'first_gradient_evaluations'):.0f} gradient evaluations of 16 sequences "
        f"against {mean(ref, 'first_gradient_evaluations'):.0f}); 1 -> 4 at 512 ends {ci(four)} "
        f"above it ({reached(four)} of 8 reach); `AdaptiveSteps` in Adam's norm ends "
        f"{ci(adaptive)} ({reached(adaptive)} of 8 reach, "
        f"{1 - mean(adaptive, 'first_updates') / ref_updates:.0%} fewer updates, "
        f"{mean(adaptive, 'first_gradient_evaluations') / ref_updates - 1:.0%} more examples "
        f"with its probes: {mean(adaptive, 'first_gradient_evaluations'):.0f})."
    )
    assert doc in _doc_words(), doc
    readme = (
        f"1 -> 2 -> 4 ends {ci(steps)} from it and reaches its final loss (plus one seed std) "
        f"in {reached(steps)} of 8 seeds with {saving:.0%} fewer serial updates "
        f"({mean(steps, 'first_updates'):.0f} against {ref_updates:.0f}) but as many examples "
        f"({mean(steps, 'first_gradient_evaluations'):.0f} micro-batches against "
        f"{mean(ref, 'first_gradient_evaluations'):.0f}); 1 -> 4 ends {ci(four)} above it"
    )
    assert readme in _readme_words(), readme
    # The spike: median jump without the ramp; seeds whose peak stays below 0.1 with it.
    spikes = controls_report.folder_spikes(DECAY)
    constant = controls_report.read_csv(CONTROLS / "runs.csv")
    ramp_rows = controls_report.read_csv(DECAY / "spike/runs.csv")
    before = controls_report.switch_spikes(constant, "1->4 at 512", "kappa=1", 8192)
    after = controls_report.switch_spikes(
        ramp_rows, "1->4 at 512 ramp", "kappa=1", 8192, reference_rows=constant
    )
    median_3e3 = np.median([j for j, _ in before.values()])
    median_6e3 = np.median([j for j, _ in spikes["1->4 at 512 wsd"].values()])
    smooth_3e3 = sum(p < 0.1 for _, p in after.values())
    smooth_6e3 = sum(p < 0.1 for _, p in spikes["1->4 at 512 ramp wsd"].values())
    doc = (
        f"(median {median_3e3:+.2f} at 3e-3, {median_6e3:+.2f} at 6e-3 with WSD) because "
        f'`"fixed_beta_1"` multiplies the per-update lr by 4 at once; '
        f"`PiecewiseSteps(..., ramp=128)` (1 -> 2 -> 3 -> 4 over 128 micro-steps) removes the "
        f"jump at 3e-3 in {smooth_3e3} of 8 seeds and at 6e-3 in {smooth_6e3} of 8."
    )
    assert doc in _doc_words(), doc
    readme = f"removes the spike in {smooth_3e3} of 8 seeds at 3e-3, {smooth_6e3} of 8 at 6e-3."
    assert readme in _readme_words(), readme


def test_the_computed_wall_clock_recomputes_from_the_committed_files():
    """The data-parallel wall-clock the docs compute (updates x the measured
    time of one micro-batch), and the one-device times beside it."""
    _, _, entries = controls_report.controls_table(DECAY, "kappa=1 wsd")
    arm = {e["arm"]: e for e in entries}
    ref = arm["kappa=1 wsd"]
    per = np.mean(ref["cpu_seconds"]) / np.mean(ref["gradient_evaluations"])

    def first(e, key):
        values = [v for v in e[key] if v is not None]
        return np.mean(values), len(values)

    steps, n_steps = first(arm["1->2->4 at 512, 1024 wsd"], "first_updates")
    ramp, n_ramp = first(arm["1->4 at 512 ramp wsd"], "first_updates")
    one, n_one = first(ref, "first_cpu_seconds")
    steps_cpu, _ = first(arm["1->2->4 at 512, 1024 wsd"], "first_cpu_seconds")
    text = (
        f"One micro-batch of 16 sequences took {per * 1000:.1f} ms of CPU here "
        f"(kappa = 1 with WSD: its CPU seconds over its 3072 gradient evaluations). "
        f"If every window's kappa micro-batches ran at once on kappa devices and "
        f"communication cost nothing, a run would take its serial updates times that: "
        f"1 -> 2 -> 4 would reach T + sigma in about {steps * per:.1f} s on 4 devices "
        f"({steps:.0f} updates, {n_steps} of 8 seeds) and 1 -> 4 with the ramp in "
        f"{ramp * per:.1f} s ({n_ramp} of 8), against {one:.1f} s measured on one device "
        f"for kappa = 1 ({n_one} of 8)."
    )
    assert text in _doc_words(), text
    assert f"longer ({steps_cpu:.1f} s for 1 -> 2 -> 4)" in _doc_words()
