"""The batch-size invariance study: smoke run end to end, and the claim in
small (tiny learning rate: InvariantAdam's curves agree across kappa, plain
accumulation's do not; at kappa = 1 all four methods are Adam exactly)."""

import csv
import itertools
import json
import math
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from keras_accum.experiments import data, invariance

ROOT = pathlib.Path(__file__).resolve().parents[1]
B = 32  # micro-batch size


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def bench(data_dir):
    """A StudyRunner on MNIST-1D (compiled loops shared by the tests, as in the
    study), seed 0's initial weights and micro-batch stream."""
    info = data.dataset_info("mnist1d", data_dir)
    x, y = invariance.load_arrays("mnist1d", "train", data_dir)
    test = invariance.load_arrays("mnist1d", "test", data_dir)
    eval_data = {"train": (x[:500], y[:500]), "test": test}
    trainer = invariance.StudyRunner("mlp", info.input_shape, info.num_classes, eval_data)
    idx = invariance.micro_batch_indices(len(x), B, 64, seed=0)
    return {
        "trainer": trainer,
        "weights": trainer.initial_weights(0),
        "xs": tf.constant(x[idx]),
        "ys": tf.constant(y[idx]),
        "info": info,
        "eval_data": eval_data,
    }


def rows_of(method, kappa, lr, points):
    return [{"method": method, "learning_rate": lr, "kappa": kappa, "seed": 0, **p} for p in points]


def test_smoke_variant_end_to_end(data_dir, tmp_path):
    config = invariance.load_config_file(ROOT / "saved_configs/invariance.py", "smoke")
    config.update(data_dir=data_dir, verbose=0)
    invariance.run_study(config, tmp_path / "out")
    out = tmp_path / "out"
    resolved = invariance.resolve_config(config)
    for name in (
        "config.json",
        "runs.csv",
        "noise_scale.csv",
        "spread.md",
        "spread_vs_lr.png",
        "summary.json",
    ) + tuple(f"curves_lr_{lr:g}.png" for lr in resolved["plot_learning_rates"]):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "config.json").read_text()) == resolved

    rows = list(csv.DictReader(open(out / "runs.csv")))
    points = range(0, resolved["train_examples"] + 1, resolved["eval_every"])
    expected = set(
        itertools.product(
            resolved["methods"],
            resolved["learning_rates"],
            resolved["kappas"],
            resolved["seeds"],
            points,
        )
    )
    keys = [
        (
            r["method"],
            float(r["learning_rate"]),
            int(r["kappa"]),
            int(r["seed"]),
            int(r["examples"]),
        )
        for r in rows
    ]
    assert len(keys) == len(set(keys)) == len(expected)
    assert set(keys) == expected
    # Matched examples: every kappa is at a window end at every point.
    for r in rows:
        assert int(r["updates"]) * int(r["kappa"]) * B == int(r["examples"])

    table = (out / "spread.md").read_text()
    for method in resolved["methods"]:
        assert f"| {method} |" in table, method
    assert "B_simple" in table
    noise = list(csv.DictReader(open(out / "noise_scale.csv")))
    # Initial model and the kappa = 1 model trained at each lr, per seed.
    assert len(noise) == len(resolved["seeds"]) * (1 + len(resolved["learning_rates"]))


def test_kappa_one_is_adam_for_every_method(bench):
    """All four methods reduce to keras Adam at kappa = 1: identical numbers
    (not merely close) for curves and final weights."""
    trainer, lr = bench["trainer"], 3e-3
    results = {}
    for method in invariance.METHODS:
        points = invariance.run_method(
            trainer, method, 1, lr, bench["weights"], bench["xs"][:16], bench["ys"][:16], 8
        )
        results[method] = (points, trainer.model.get_weights())
    ref_points, ref_weights = results["invariant"]
    assert ref_points[-1]["train_loss"] < ref_points[0]["train_loss"]
    for method, (points, weights) in results.items():
        assert points == ref_points, method
        for a, b in zip(weights, ref_weights):
            np.testing.assert_array_equal(a, b, err_msg=method)


def test_tiny_lr_invariant_curves_agree_plain_ones_do_not(bench):
    """The claim in small: at a tiny learning rate, InvariantAdam with the
    linear rule gives nearly the same curve versus examples seen for
    kappa = 1 and 4; plain accumulation (no rescaling, 4x fewer updates)
    does not, and the square-root rule for standard Adam does much worse
    than InvariantAdam. Spread = max - min over kappa, averaged over 8
    points. Measured: invariant/plain ~ 0.015, invariant/sqrt ~ 0.04."""
    trainer, lr = bench["trainer"], 1e-4
    xs, ys, w = bench["xs"], bench["ys"], bench["weights"]
    adam = invariance.run_method(trainer, "invariant", 1, lr, w, xs, ys, 8)
    rows = {
        m: rows_of(m, 1, lr, adam)
        + rows_of(m, 4, lr, invariance.run_method(trainer, m, 4, lr, w, xs, ys, 8))
        for m in ("invariant", "plain", "sqrt")
    }
    spread = {m: invariance.spreads(r, [1, 4])[m, lr, 0] for m, r in rows.items()}
    moved = adam[0]["train_loss"] - adam[-1]["train_loss"]
    assert moved > 0.05  # the curves are not flat: the test has teeth
    for metric in ("train_loss", "test_loss"):
        inv, plain = spread["invariant"][metric][0], spread["plain"][metric][0]
        assert inv < 0.1 * plain, (metric, inv, plain)
        assert inv < 0.25 * spread["sqrt"][metric][0], metric
    assert spread["plain"]["train_loss"][0] > 0.1 * moved


def test_power_and_fixed_beta_1_methods_follow_their_rules():
    h = invariance.optimizer_hyperparameters("power", 8, 1e-3)
    assert h == pytest.approx(
        {"learning_rate": 8e-3, "beta_1": 0.9**8, "beta_2": 0.999**8, "epsilon": 1e-7}
    )
    h = invariance.optimizer_hyperparameters("fixed_beta_1", 8, 1e-3)
    assert h == pytest.approx(
        {"learning_rate": 8e-3, "beta_1": 0.9, "beta_2": 0.999**8, "epsilon": 1e-7}
    )
    assert type(invariance.method_optimizer("power", 8, 1e-3)).__name__ == "InvariantAdam"


def test_frontier_gap_noise_ratio_by_hand():
    """kappa = 1 train losses at the 2 points after the start, seeds 0-2:
    (1.0, 0.8), (1.2, 0.6), (1.1, 0.7): seed std 0.1 at each point. kappa = 8
    is off by 0.05 at lr 1e-3 (ratio 0.5) and by 0.3 at lr 1e-2 (ratio 3);
    method `sqrt` by 0.3 at both. Test loss = 2 x train loss: same ratios."""
    from keras_accum.experiments.invariance import report

    k1 = np.array([[9.0, 1.0, 0.8], [9.0, 1.2, 0.6], [9.0, 1.1, 0.7]])  # [seed, point]
    offsets = {("invariant", 1e-3): 0.05, ("invariant", 1e-2): 0.3}
    config = {
        "methods": ["invariant", "sqrt"],
        "learning_rates": [1e-3, 1e-2],
        "seeds": [0, 1, 2],
        "kappas": [1, 8],
    }
    rows = []
    for (method, lr, seed, kappa), (i, e) in itertools.product(
        itertools.product(config["methods"], config["learning_rates"], [0, 1, 2], [1, 8]),
        enumerate([0, 256, 512]),
    ):
        sign = 1 if seed % 2 else -1  # |gap| whatever its sign
        # At examples = 0 (left out of both averages): seed std 0, gap 1.
        offset = offsets.get((method, lr), 0.3) if i else 1.0
        loss = k1[seed, i] + (kappa == 8) * sign * offset
        rows.append(
            {"method": method, "learning_rate": lr, "kappa": kappa, "seed": seed, "examples": e}
            | {"train_loss": loss, "test_loss": 2 * loss, "test_accuracy": 0.0}
        )
    table = report.frontier(rows, config)
    noise = np.mean(np.std(k1[:, 1:], axis=0, ddof=1))
    assert noise == pytest.approx(0.1)
    for key, gap in list(offsets.items()) + [(("sqrt", 1e-3), 0.3)]:
        assert table[key]["train_loss"] == pytest.approx((gap, 0.1, gap / 0.1))
        assert table[key]["test_loss"] == pytest.approx((2 * gap, 0.2, gap / 0.1))
    assert report.frontier_lr(table, "invariant") == 1e-3
    assert report.frontier_lr(table, "sqrt") is None
    text = "\n".join(report._frontier_table(rows, config))
    assert "| invariant | 0.001 | 5.00e-02 | 1.00e-01 | 0.50 |" in text
    # The ratio rises from 0.5 to 3 between lr 1e-3 and 1e-2: through 2 at
    # log10(lr / 1e-3) = log(2 / 0.5) / log(3 / 0.5).
    crossing = 1e-3 * 10 ** (math.log(4) / math.log(6))
    assert f"| invariant | 0.001 | 0.001 | {crossing:.2g} |" in text
    assert "| sqrt | none | none | < 0.001 |" in text
    for missing in ({"kappas": [1, 4]}, {"seeds": [0]}):
        assert report.frontier(rows, config | missing) == {}


def test_reused_compiled_loop_equals_a_fresh_one(bench):
    """The study reuses one compiled loop per (method, kappa) across learning
    rates and seeds; resetting the state must leave no trace of the
    previous run."""
    trainer, xs, ys = bench["trainer"], bench["xs"][:16], bench["ys"][:16]
    invariance.run_method(trainer, "sqrt", 2, 1e-2, trainer.initial_weights(1), xs, ys, 8)
    reused = invariance.run_method(trainer, "sqrt", 2, 1e-3, bench["weights"], xs, ys, 8)
    fresh = invariance.StudyRunner(
        "mlp", bench["info"].input_shape, bench["info"].num_classes, bench["eval_data"]
    )
    assert invariance.run_method(fresh, "sqrt", 2, 1e-3, bench["weights"], xs, ys, 8) == reused


def test_same_stream_for_every_kappa_and_epochs_are_permutations():
    idx = invariance.micro_batch_indices(100, 8, 30, seed=3)
    assert idx.shape == (30, 8)
    flat = idx.ravel()
    for start in range(0, 200, 100):  # two whole epochs in the 240 items
        assert sorted(flat[start : start + 100]) == list(range(100))
    np.testing.assert_array_equal(idx, invariance.micro_batch_indices(100, 8, 30, seed=3))


@pytest.mark.parametrize(
    "override,match",
    [
        ({"eval_every": 128}, r"multiple of the largest window .* = 256"),
        ({"train_examples": 1000}, "multiple of `eval_every`"),
        ({"methods": ["adam"]}, r"`methods\[0\]` must be one of .*Received: methods\[0\]='adam'"),
        ({"methods": []}, r"`methods` must be a list of at least 1 item"),
        ({"seeds": [-1]}, r"`seeds\[0\]` must be an integer >= 0"),
        ({"learning_rates": [0.0]}, r"`learning_rates\[0\]` must be a finite number > 0"),
        ({"beta_2": 1.0}, r"`beta_2` must be a finite number in \[0.0, 1.0\)"),
        ({"noise_scale_kappa": 1}, r"`noise_scale_kappa` must be an integer >= 2"),
        ({"kappas": [1, 16]}, r"kappa \* \(1 - beta_1\)"),
        ({"plot_learning_rates": [0.5]}, "must be among `learning_rates`"),
        ({"stpes": 1}, r"Unknown config key 'stpes'. Valid keys: .*micro_batch_size"),
    ],
)
def test_bad_configs_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        invariance.resolve_config(override)


@pytest.mark.parametrize(
    "names,refused",
    [
        ([], None),
        (["config.json", ".runs.csv.tmp-7"], None),  # killed while training or writing
        (["config.json", "runs.csv", "spread.md", "curves_lr_0.01.png"], None),
        (["config.json", "runs.csv", "summary.json"], "not empty"),  # finished
        (["config.json", "notes.txt"], "not empty"),
    ],
)
def test_an_unfinished_study_folder_is_reused_others_refused(names, refused, tmp_path):
    from keras_accum.experiments.invariance import study

    out = tmp_path / "out"
    out.mkdir()
    for name in names:
        (out / name).write_text("x")
    if refused:
        with pytest.raises(FileExistsError, match=refused):
            study._check_workdir(out)
        assert sorted(p.name for p in out.iterdir()) == sorted(names)
    else:
        assert sorted(p.name for p in study._check_workdir(out)) == sorted(names)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="workdir"):
        study._check_workdir(tmp_path / "file" / "out")


def test_crossing_lr_interpolates_in_log_log():
    lrs, values = [1e-4, 1e-3, 1e-2], [0.01, 0.1, 10.0]
    # Between 1e-3 (0.1) and 1e-2 (10): 1.0 is half way in log value.
    assert invariance.report.crossing_lr(lrs, values, 1.0) == pytest.approx(math.sqrt(1e-3 * 1e-2))
    assert invariance.report.crossing_lr(lrs, values, 0.001) == 0.0
    assert invariance.report.crossing_lr(lrs, values, 100.0) == math.inf
