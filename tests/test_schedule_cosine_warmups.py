"""The batch-size warmups with the cosine decay at cosine's tuned lr
against kappa = 1 with the same decay (issue #42): every number of
docs/BATCH_SIZE_SCHEDULES.md's "The warmups with the cosine decay"
recomputed from the committed files (no training, no network)."""

import json
import pathlib

import numpy as np

from keras_accum.experiments import controls_report, experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECAY = ROOT / "docs/batch_size_schedules/decay"
WARMUPS = DECAY / "cosine_warmups"
DOC = ROOT / "docs/BATCH_SIZE_SCHEDULES.md"
CONFIG = ROOT / "saved_configs/schedule_cosine.py"
COSINE = "kappa=1 cosine"
ARMS = (COSINE, "1->4 at 512 cosine", "1->2->4 at 512, 1024 cosine")


def _doc_words():
    return " ".join(DOC.read_text().split())


def _rows(text):
    return [x for x in text.splitlines() if x.startswith("| ") and "| arm |" not in x]


def _spikes():
    """Over 12 evaluations after the first switch (past 1 -> 2 -> 4's second)."""
    main = controls_report.read_csv(DECAY / "runs.csv")
    warm = controls_report.read_csv(WARMUPS / "runs.csv")
    return {
        arm: controls_report.switch_spikes(
            warm, arm, COSINE, 8192, reference_rows=main, evaluations=12
        )
        for arm in ARMS[1:]
    }


def _ci(e):
    diff, low, high = e["welch"]
    return f"{diff:+.4f} [{low:+.4f}, {high:+.4f}]"


def _mean(e, key):
    return np.mean([v for v in e[key] if v is not None])


def _reached(e):
    return sum(v is not None for v in e["first_updates"])


def test_docs_cosine_warmup_sentences_recompute_from_the_committed_files():
    words = _doc_words()
    _, _, entries = controls_report.combined_table([DECAY, WARMUPS], COSINE, ARMS)
    ref, four, steps = entries
    saving = 1 - _mean(steps, "first_updates") / _mean(ref, "first_updates")
    assert _reached(four) == 0
    short = (
        f"With the cosine decay at its own tuned lr, 1 -> 2 -> 4 ends {_ci(steps)} from kappa = 1 "
        f"with cosine and reaches its T + sigma in {_reached(steps)} of 8 seeds with {saving:.0%} "
        f"fewer updates ({_mean(steps, 'first_updates'):.0f} against "
        f"{_mean(ref, 'first_updates'):.0f}) and as many examples "
        f"({_mean(steps, 'first_gradient_evaluations'):.0f} gradient evaluations against "
        f"{_mean(ref, 'first_gradient_evaluations'):.0f}); 1 -> 4 ends {_ci(four)} above it "
        f"({_reached(four)} of 8 reach)."
    )
    assert short in words, short
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert short in readme, short  # the README's short answer says the same
    body = (
        f"1 -> 2 -> 4 ends {_ci(steps)} from kappa = 1 with cosine (not an equivalence: 8 seeds) "
        f"and reaches its T + sigma in {_reached(steps)} of 8 seeds, with {saving:.0%} fewer "
        f"serial updates ({_mean(steps, 'first_updates'):.0f} against "
        f"{_mean(ref, 'first_updates'):.0f}) and as many examples "
        f"({_mean(steps, 'first_gradient_evaluations'):.0f} gradient evaluations against "
        f"{_mean(ref, 'first_gradient_evaluations'):.0f}). 1 -> 4 at 512 ends {_ci(four)} above "
        "it and never reaches it"
    )
    assert body in words, body
    spikes = _spikes()
    peaks = {a: [p for _, p in s.values()] for a, s in spikes.items()}
    spiked = {a: [seed for seed, (_, p) in s.items() if p > 0.1] for a, s in spikes.items()}
    four_peaks = peaks[ARMS[1]]
    assert (
        f"its switch spikes in {len(spiked[ARMS[1]])} of 8 seeds (peak {min(four_peaks):+.3f} to "
        f"{max(four_peaks):+.3f}, median {np.median(four_peaks):+.3f}), where 1 -> 2 -> 4 spikes "
        f"in {len(spiked[ARMS[2]])} of 8 (seed {spiked[ARMS[2]][0]}, "
        f"{max(peaks[ARMS[2]]):+.3f}, at its 2 -> 4 switch)"
    ) in words
    # The 2 -> 4 switch (micro-step 1024 = 16384 examples) is where seed 2 peaks.
    warm = controls_report.arm_curves(controls_report.read_csv(WARMUPS / "runs.csv"), ARMS[2])
    main = controls_report.arm_curves(controls_report.read_csv(DECAY / "runs.csv"), COSINE)
    seed = spiked[ARMS[2]][0]
    ref_loss = {p["examples"]: p["test_loss"] for p in main[seed]}
    worst = max(warm[seed], key=lambda p: p["test_loss"] - ref_loss[p["examples"]])
    assert 16384 < worst["examples"] <= 16384 + 4 * 1024
    # Against kappa = 1 with WSD.
    _, _, against_wsd = controls_report.combined_table(
        [DECAY, WARMUPS], "kappa=1 wsd", ("kappa=1 wsd", *ARMS[1:])
    )
    assert (
        f"1 -> 2 -> 4 with cosine {_ci(against_wsd[2])}, 1 -> 4 {_ci(against_wsd[1])}."
    ) in words
    seconds = json.loads((WARMUPS / "summary.json").read_text())["seconds"]
    assert f"the cosine warmups 16 runs, {seconds / 60:.1f} min." in words


def test_the_runs_are_the_config_at_cosines_tuned_lr():
    config = controls_report.load(WARMUPS)[0]
    tuned = controls_report.best_learning_rate(DECAY / "tune", COSINE)
    assert config["learning_rates"] == [tuned] and config["seeds"] == list(range(8))
    expected = experiment.load_config_file(CONFIG, "cosine_warmups")["arms"]
    assert config["arms"] == expected and list(expected) == list(ARMS[1:])


def test_docs_cosine_warmup_tables_recompute_from_the_committed_files():
    doc = DOC.read_text()
    t, sigma, entries = controls_report.combined_table([DECAY, WARMUPS], COSINE, ARMS)
    assert [e["arm"] for e in entries] == list(ARMS)
    assert [len(e["seeds"]) for e in entries] == [8, 8, 8]
    rows = _rows(controls_report.table_markdown(t, sigma, entries, COSINE))
    rows += _rows(controls_report.spike_markdown(_spikes(), 12))
    missing = [x for x in rows if x not in doc]
    assert not missing, missing
    line = (
        f"T = {t:.4f} (mean final test loss of {COSINE}), sigma = {sigma:.4f} (its seed std); "
        f"threshold T + sigma = {t + sigma:.4f}."
    )
    assert line in _doc_words()
    assert np.isfinite(t)
