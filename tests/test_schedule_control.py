"""Issue #50's control (constant kappa = 2 and 4 at their own tuned decay,
the warmups at more than the borrowed lr): the protocol as committed, the
tuned lrs from the tuning files, and every number that
docs/BATCH_SIZE_SCHEDULES.md, the README's short answer and
docs/guides/schedules.md quote from it, recomputed from the committed raw
files (reads files only: no training, no network)."""

import pathlib

import numpy as np
import pytest

from keras_accum.experiments import control_report as report
from keras_accum.experiments import controls_report as cr
from keras_accum.experiments import experiment, schedules_controls

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs/BATCH_SIZE_SCHEDULES.md"
GUIDE = ROOT / "docs/guides/schedules.md"
README = ROOT / "README.md"
CONFIG = ROOT / "saved_configs/schedule_control.py"
MODULE = report.protocol()


def _words(path):
    return " ".join(path.read_text().split())


def _ran(task):
    return [t for t in report.TASKS if report.parts(t)] if task is None else task


def test_protocol_fixes_criterion_spike_window_grid_and_seeds():
    p = MODULE.PROTOCOL
    assert p["tuning_seeds"] == [100, 101, 102] and p["seeds"] == list(range(8))
    assert (p["spike_threshold"], p["spike_window_evaluations"]) == (0.1, 4)
    assert p["eval_every_examples"] * p["evaluations"] == 49152
    assert p["devices"] == 4
    assert len(MODULE.MNIST1D_GRID) >= 4 and len(MODULE.CHARLM_GRID) >= 4
    assert 3e-3 in MODULE.WARMUP_LRS["charlm"] and len(MODULE.WARMUP_LRS["mnist1d_cnn"]) >= 2
    for variant in MODULE.VARIANTS:
        try:
            config = experiment.load_config_file(CONFIG, variant)
        except ValueError as e:  # a control whose tuning has not run
            assert "no tuned lr yet" in str(e)
            continue
        resolved = schedules_controls.resolve_config(config)
        if variant != "smoke":
            assert resolved["eval_every"] == p["eval_every_examples"]
            assert resolved["seeds"] in (p["seeds"], p["tuning_seeds"])


def test_every_run_arm_is_planned_or_marked_added():
    for task in report.TASKS:
        for path in report.parts(task):
            for arm in cr.load(path)[0]["arms"]:
                status = report._status(task, arm, [])
                planned = arm in MODULE.PROTOCOL["planned"][task]
                assert status == ("planned" if planned else "added"), arm
                # an added arm is named in the config's "Added after" paragraph
                if not planned:
                    assert path.name in CONFIG.read_text(), path


@pytest.mark.parametrize("task", list(report.TASKS))
def test_tuned_lrs_follow_the_committed_rule(task):
    """TUNED is the lowest mean final val_loss of the tuning files, each
    tuned on >= 4 lrs x 3 seeds; a winner at the grid's edge has the point
    beyond it run, and still wins or is replaced."""
    grid = MODULE.MNIST1D_GRID if task == "mnist1d_cnn" else MODULE.CHARLM_GRID
    for decay in ("wsd", "cosine"):
        for arm, finals in report.tuning(task, decay).items():
            assert len(finals) >= 4 and all(len(v) == 3 for v in finals.values())
            best, edge = report.choose(finals, grid)
            assert MODULE.TUNED[task][arm] == best, arm
            assert not edge, f"{arm}: {best} is at the edge of what ran"
            on_grid = [lr for lr in finals if any(np.isclose(lr, g) for g in grid)]
            assert len(on_grid) == len(grid)


@pytest.mark.parametrize("task", list(report.TASKS))
def test_docs_tables_recompute_from_the_committed_files(task):
    if not report.parts(task):
        pytest.skip(f"no {task} run")
    doc = DOC.read_text()
    texts = [report.tuning_markdown(task), report.table_markdown(task)]
    texts += [report.versus_markdown(task), report.warmup_val_markdown(task)]
    texts += [report.spike_section(task)]
    if report.tuning(task, "cosine") and any(
        "cosine" in a for p in report.parts(task) for a in cr.load(p)[0]["arms"]
    ):
        texts += [
            report.tuning_markdown(task, "cosine"),
            report.table_markdown(task, report.COSINE),
        ]
    for text in texts:
        missing = [x for x in text.splitlines() if x and x not in doc]
        assert not missing, missing


def test_wall_clock_at_equal_devices_is_examples_over_devices():
    """The computed wall-clock gives kappa = 1 the same 4 devices: every
    arm of 3072 micro-batches costs the same to the end."""
    for task in _ran(None):
        t = report.seconds_per_micro_batch(task)
        for e in report.entries(task)[2]:
            assert e["devices_seconds"] == pytest.approx([3072 * t / 4] * len(e["seeds"]))


def _norm(text):
    return " ".join(text.split())


def test_docs_section_is_the_report_of_the_committed_files():
    """The study's section, prose numbers and tables, is what
    `control_report.section_markdown()` computes from the raw files."""
    doc = _norm(DOC.read_text())
    assert _norm(report.section_markdown()) in doc


def test_readme_and_guide_answer_the_control_question_from_the_files():
    assert _norm(report.control_paragraph()) in _norm(README.read_text())
    guide = report.control_paragraph("../BATCH_SIZE_SCHEDULES.md")
    assert _norm(guide) in _norm(GUIDE.read_text())
    # the guide no longer ends its study summary on the constant-lr saving
    text = _norm(GUIDE.read_text())
    assert text.index("55% fewer updates") < text.index(_norm(guide))
    assert "the finding holds" not in _norm(README.read_text())
    assert "the finding holds" not in _norm(DOC.read_text())


def test_borrowed_lr_gaps_recompute_from_the_decay_studies_tuning():
    assert f"{report.borrowed_gap('charlm', 3e-3)[1]:.2f}" == "0.54"
    assert f"{report.borrowed_gap('mnist1d_cnn', 1.13e-2)[1]:.2f}" == "0.19"


def test_the_spike_counts_the_decay_study_quotes_recompute():
    """The moved definitions, now said: the 256 ramp is counted over 12
    evaluations (over 4 every seed is smooth), and at 0.05 the 128 ramp
    spikes in 5 of 8 seeds."""
    base = report.BASELINE["charlm"]
    _, main, _, _ = cr.load(base)
    _, rows256, _, _ = cr.load(base / "ramp256")
    arm256 = "1->4 at 512 ramp 256 wsd"
    over = {n: cr.switch_spikes(rows256, arm256, report.WSD, 8192, main, n) for n in (4, 12)}
    assert sum(p < 0.1 for _, p in over[4].values()) == 8
    assert sum(p < 0.1 for _, p in over[12].values()) == 7
    ramp128 = cr.switch_spikes(main, "1->4 at 512 ramp wsd", report.WSD, 8192)
    ramp128_12 = cr.switch_spikes(main, "1->4 at 512 ramp wsd", report.WSD, 8192, None, 12)
    assert sum(p > 0.05 for _, p in ramp128.values()) == 5
    assert sum(p > 0.1 for _, p in ramp128.values()) == 2
    assert sum(p < 0.1 for _, p in ramp128_12.values()) == 6
    doc = _norm(DOC.read_text())
    assert "over it all 8 seeds are smooth; over 12 the 128 ramp is also 6 of 8" in doc
    assert "at 0.05 the 128 ramp at 6e-3 spikes in 5 of 8 seeds, not 2" in doc
    assert "at 0.05 the 128 ramp is smooth in 3 of 8" in doc
