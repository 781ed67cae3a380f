"""The schedule controls (issue #35): the criteria against hand-computed
values, the report's replay of AdaptiveSteps against the class, the config
checks, the committed files against docs/BATCH_SIZE_SCHEDULES.md, and (slow)
a smoke study end to end, including that a rerun of a seed is identical."""

import csv
import gzip
import json
import pathlib

import keras
import numpy as np
import pytest
from scipy import stats

import keras_accum as ka
from keras_accum.experiments import config as cfg
from keras_accum.experiments import controls_report, experiment, schedules_controls

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTROLS = ROOT / "docs/batch_size_schedules/controls"
DOC = ROOT / "docs/BATCH_SIZE_SCHEDULES.md"


def points(losses, kappa=1):
    return [
        {"updates": i * 64 // kappa, "gradient_evaluations": i * 64, "seconds": i, "test_loss": v}
        for i, v in enumerate(losses)
    ]


def test_first_reach_interpolates_and_settled_needs_the_trailing_mean_to_stay():
    curve = points([4.0, 1.0, 0.4, 0.8, 0.5, 0.45, 0.44])
    # 1.0 -> 0.4 crosses 0.5 five sixths of the way from update 64 to 128.
    assert controls_report.first_reach(curve, 0.5) == pytest.approx(64 + 64 * 5 / 6)
    assert controls_report.first_reach(curve, 0.5, x="seconds") == pytest.approx(1 + 5 / 6)
    # Trailing means of 3: ..., (0.4+0.8+0.5)/3 = 0.567, 0.583, 0.463: below from index 6 on.
    assert controls_report.settled(curve, 0.5) == 6 * 64
    assert controls_report.settled(curve, 0.6) == 4 * 64
    assert controls_report.settled(curve, 0.3) is None
    assert controls_report.first_reach(curve, 0.3) is None


def test_welch_interval_is_scipys():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.5, 0.01, 8), rng.normal(0.49, 0.003, 8)
    diff, low, high = controls_report.welch(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert diff == pytest.approx(a.mean() - b.mean())
    assert (low, high) == pytest.approx((ci.low, ci.high))


def test_replayed_decisions_are_adaptive_steps():
    rng = np.random.default_rng(1)
    estimates = list(rng.uniform(0, 150, 30)) + [float("nan"), float("inf")]
    schedule = ka.AdaptiveSteps(1, 8, 16, powers_of_two=True)
    opt = ka.InvariantAdam(1e-3, steps=schedule, scaling_rule="fixed_beta_1")
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    got = [int(schedule.observe(b)) for b in estimates]
    assert controls_report.replay_decisions(estimates, 16, 8) == got


@pytest.mark.parametrize(
    "arms",
    [
        {"a": {"steps": 3}},
        {"a": {"steps": 16}},
        {"a": {"steps": [[100], [1, 4]]}},  # not a multiple of eval_every / b = 64
        {"a": {"steps": "adaptive", "estimate": "adam"}},
        {"a": {"steps": 1, "decay": "linear"}},
        {"a": {"steps": 1, "lr": 1e-3}},
    ],
)
def test_bad_arms_are_refused(arms):
    with pytest.raises(cfg.ConfigError, match="arms"):
        schedules_controls.resolve_config({"arms": arms})


def test_saved_variants_resolve_with_switch_points_fixed():
    for variant in ("tune", "tune_kappa4", "controls", "smoke"):
        config = experiment.load_config_file(ROOT / "saved_configs/schedule_controls.py", variant)
        schedules_controls.resolve_config(config)
    controls = experiment.load_config_file(ROOT / "saved_configs/schedule_controls.py", "controls")
    assert controls["arms"]["1->2->4 at 512, 1024"]["steps"] == [[512, 1024], [1, 2, 4]]
    assert controls["arms"]["late 1->4 at 2304"]["steps"] == [[2304], [1, 4]]
    assert controls["scaling_rule"] == "fixed_beta_1" and len(controls["seeds"]) == 8


def test_cosine_schedule_goes_from_peak_to_zero():
    import tensorflow as tf

    peak = tf.Variable(3e-3)
    schedule = schedules_controls.CosineToZero(peak, 100)
    assert float(schedule(0)) == pytest.approx(3e-3)
    assert float(schedule(50)) == pytest.approx(1.5e-3)
    assert float(schedule(100)) == pytest.approx(0.0, abs=1e-12)
    assert float(schedule(150)) == pytest.approx(0.0, abs=1e-12)


# -- the committed files against the docs ---------------------------------------


def _final_test_losses(arm):
    """{seed: final test loss} of `arm`'s first runs, read with csv alone."""
    finals = {}
    with gzip.open(CONTROLS / "runs.csv.gz", "rt", newline="") as f:
        for row in csv.DictReader(f):
            if row["arm"] == arm and row["rerun"] == "0":
                finals[int(row["seed"])] = float(row["test_loss"])  # the last row wins
    return finals


def test_docs_threshold_recomputes_from_the_committed_curves():
    """T and sigma of the docs from runs.csv.gz with csv and numpy only."""
    finals = list(_final_test_losses("kappa=1").values())
    t, sigma = np.mean(finals), np.std(finals, ddof=1)
    line = f"T = {t:.4f} (mean final test loss of kappa=1), sigma = {sigma:.4f}"
    assert len(finals) == 8
    assert line in DOC.read_text() and line in (CONTROLS / "summary.md").read_text()


def test_docs_controls_table_recomputes_from_the_committed_files():
    """Every row of the controls tables the report computes from the
    committed files is in the docs (against kappa = 1 both tables, against
    the cosine baseline the first), and one entry by hand: kappa = 4's
    final test loss difference to kappa = 1."""
    doc = DOC.read_text()
    for reference, tables in (("kappa=1", 2), ("kappa=1 cosine", 1)):
        t, sigma, entries = controls_report.controls_table(CONTROLS, reference)
        text = controls_report.table_markdown(t, sigma, entries, reference)
        text = text.split("Savings against")[0] if tables == 1 else text
        rows = [x for x in text.splitlines() if x.startswith("| ") and "| arm |" not in x]
        assert len(rows) >= 12 * tables
        missing = [x for x in rows if x not in doc]
        assert not missing, missing
    ones, fours = _final_test_losses("kappa=1"), _final_test_losses("kappa=4")
    diff = np.mean(list(fours.values())) - np.mean(list(ones.values()))
    t, sigma, entries = controls_report.controls_table(CONTROLS)
    kappa4 = controls_report.table_markdown(t, sigma, entries).split("| kappa=4 | ")[1]
    assert kappa4.split(" | ")[2].startswith(f"{diff:+.4f} [")


def test_tuned_learning_rates_recompute_from_the_committed_validation_losses():
    """The config's tuned lrs are the best final val_loss of the committed
    tuning runs (test loss never read), and the docs' tuning table is the
    one the report computes."""
    config = experiment.load_config_file(ROOT / "saved_configs/schedule_controls.py", "controls")
    tune = CONTROLS / "tune"
    assert controls_report.best_learning_rate(tune, "kappa=1") == config["learning_rates"][0]
    cosine = config["arms"]["kappa=1 cosine"]["learning_rates"][0]
    assert controls_report.best_learning_rate(tune, "kappa=1 cosine") == cosine
    doc = DOC.read_text()
    for row in controls_report.tuning_table(tune).splitlines()[2:]:
        assert row in doc, row


def test_docs_determinism_check_recomputes():
    reruns = controls_report.rerun_difference(controls_report.read_csv(CONTROLS / "runs.csv"))
    assert set(reruns) == {"kappa=1", "adaptive"}
    summary = (CONTROLS / "summary.md").read_text()
    for arm, diff in reruns.items():
        assert f"* {arm}: {diff:.3g}" in summary
    # A second process (rerun/) against the study's seed 0: the docs say 0.
    across = controls_report.folder_difference(CONTROLS, CONTROLS / "rerun")
    assert set(across) == {("kappa=1", 0.003, 0), ("adaptive", 0.003, 0)}
    assert set(reruns.values()) == set(across.values()) == {0.0}


def _doc_words():
    """The docs with each run of whitespace made one space (line breaks moved)."""
    return " ".join(DOC.read_text().split())


def test_docs_same_seed_comparison_of_the_two_estimates_recomputes():
    """The b_simple arm on the preconditioned arm's 8 seeds: the seeds that
    settle, its final test loss, and its two worst seeds."""
    finals = _final_test_losses("adaptive")
    assert sorted(finals) == sorted(_final_test_losses("adaptive preconditioned")) == list(range(8))
    t, sigma, entries = controls_report.controls_table(CONTROLS)
    adaptive = next(e for e in entries if e["arm"] == "adaptive")
    settled = [s for s, v in zip(adaptive["seeds"], adaptive["settled_updates"]) if v is not None]
    worst = sorted(finals, key=finals.get)[-2:][::-1]
    values = list(finals.values())
    text = (
        f"`b_simple` arm, on the same 8 seeds, settles in {len(settled)} of 8 (seeds "
        f"{', '.join(map(str, settled[:-1]))}, {settled[-1]}) and ends at "
        f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}, seeds {worst[0]} and {worst[1]} "
        f"at {finals[worst[0]]:.3f} and {finals[worst[1]]:.3f}."
    )
    assert text in _doc_words(), text


def test_docs_cosine_gap_to_the_best_constant_lr_arm_recomputes():
    """kappa = 1 with the cosine decay against the best constant-lr arm on
    the same examples (the preconditioned adaptive one), and by hand
    against constant kappa = 1, from runs.csv.gz with csv alone."""
    gap, best = controls_report.gap_to_best_constant_lr(CONTROLS)
    assert best == "adaptive preconditioned"
    means = {
        arm: np.mean(list(_final_test_losses(arm).values()))
        for arm in (best, "kappa=1", "kappa=1 cosine")
    }
    assert gap == pytest.approx(means[best] - means["kappa=1 cosine"], abs=1e-12)
    to_kappa_1 = means["kappa=1"] - means["kappa=1 cosine"]
    text = (
        f"ends {gap:.4f} below the best constant-lr arm (the preconditioned adaptive one; "
        f"{to_kappa_1:.4f} below constant kappa = 1)"
    )
    assert text in _doc_words(), text


# -- a smoke study end to end (slow) ----------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    config = experiment.load_config_file(ROOT / "saved_configs/schedule_controls.py", "smoke")
    config["data_dir"] = str(tmp_path_factory.mktemp("tfds"))
    out = tmp_path_factory.mktemp("controls")
    return schedules_controls.run_study(config, out), out


def test_smoke_study_writes_its_files_and_reruns_identically(smoke):
    study, out = smoke
    for name in ("config.json", "runs.csv", "decisions.csv", "timings.csv", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "summary.json").read_text())["runs"] == len(study.timings)
    # The same seed twice in one process: the same curve, to the bit.
    reruns = controls_report.rerun_difference(controls_report.read_csv(out / "runs.csv"))
    assert reruns == {"adaptive preconditioned": 0.0}
    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"val_loss", "test_loss", "gradient_evaluations", "seconds"} <= set(rows[0])


def test_smoke_arms_count_updates_gradients_and_kappa(smoke):
    study, _ = smoke
    c = study.config
    b, chunk = c["micro_batch_size"], c["eval_every"] // c["micro_batch_size"]
    total = c["train_examples"] // b
    runs = controls_report.curves(study.rows)
    end = {k[0]: v[-1] for k, v in runs.items() if not k[3]}
    assert end["kappa=1"]["updates"] == total and end["kappa=4"]["updates"] == total // 4
    # 1 until 16, 2 until 32, 4 after: 16 + 8 + 8 updates.
    assert end["1->2->4 at 16, 32"]["updates"] == 16 + 16 // 2 + (total - 32) // 4
    # The probes: 4 windows of 8 micro-batches after every chunk.
    probes = (total // chunk) * c["probe_windows"] * 8
    assert end["adaptive preconditioned"]["gradient_evaluations"] == total + probes
    assert end["kappa=1"]["gradient_evaluations"] == total
    # Both estimates of the same probe gradients are logged; the one fed is
    # the arm's.
    d = study.decisions[-1]
    assert d["estimate"] == "adam_preconditioned"
    assert np.isfinite(d["b_b_simple"]) and np.isfinite(d["b_adam_preconditioned"])
    # A cosine run from the same weights and stream differs from the constant one.
    assert end["kappa=1 cosine"]["test_loss"] != end["kappa=1"]["test_loss"]
