"""The batch-size schedules study (smoke run end to end, with the
properties its runs must have whatever the numbers), the character LM, and
runs configured with a steps schedule."""

import pathlib

import numpy as np
import pytest

import keras_accum as ka
from keras_accum.experiments import config as cfg
from keras_accum.experiments import experiment, run_config, schedules_study

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    config = experiment.load_config_file(ROOT / "saved_configs/batch_size_schedules.py", "smoke")
    config["data_dir"] = str(tmp_path_factory.mktemp("tfds"))
    out = tmp_path_factory.mktemp("out")
    return schedules_study.run_study(config, out), out


def curve(rows, experiment_name, method, run):
    return {
        r["examples"]: r
        for r in rows
        if (r["experiment"], r["method"], r["run"]) == (experiment_name, method, run)
    }


def test_writes_its_outputs(study):
    result, out = study
    for name in ("config.json", "runs.csv", "decisions.csv", "summary.md", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "switch_lr_0.001.png").exists() and (out / "adaptive_lr_0.001.png").exists()
    assert "## Switch kappa = 1 -> 8" in (out / "summary.md").read_text()


@pytest.mark.parametrize("method", ["invariant", "power", "sqrt"])
def test_switch_run_is_the_kappa1_run_until_the_switch(study, method):
    result, _ = study
    c = result.config
    ones, switch = (curve(result.rows, "switch", method, r) for r in ("kappa=1", "switch"))
    before = [e for e in ones if e <= c["switch_examples"]]
    after = [e for e in ones if e > c["switch_examples"]]
    for e in before:
        np.testing.assert_allclose(switch[e]["train_loss"], ones[e]["train_loss"], rtol=1e-5)
        assert switch[e]["kappa"] == 1
    assert all(switch[e]["kappa"] == c["switch_kappa"] for e in after)
    # One update per micro-batch, then one per 8.
    b = c["micro_batch_size"]
    end = max(ones)
    expected = c["switch_examples"] // b + (end - c["switch_examples"]) // (b * 8)
    assert switch[end]["updates"] == expected


def test_adaptive_window_never_shrinks_and_saves_updates(study):
    result, _ = study
    adaptive = curve(result.rows, "adaptive", "power", "adaptive")
    kappas = [adaptive[e]["kappa"] for e in sorted(adaptive)]
    assert kappas == sorted(kappas) and kappas[0] == 1
    ones = curve(result.rows, "adaptive", "power", "kappa=1")
    assert adaptive[max(adaptive)]["updates"] < ones[max(ones)]["updates"]
    steps = [d["steps"] for d in result.decisions]
    assert steps and steps == sorted(steps)


# -- the warmup experiment --------------------------------------------------

WARMUP = {
    "micro_batch_size": 8,
    "seeds": [0],
    "train_examples": 256,  # 32 micro-batches
    "eval_every": 32,
    "probe_every": 32,
    "probe_windows": 1,
    "switch_kappa": 4,
    "switch_examples": 128,
    "adaptive_max_steps": 4,
    "switch_learning_rates": [],
    "adaptive_learning_rates": [],
    "warmup_learning_rates": [1e-2],
    "warmup_kappa": 4,
    "warmup_boundaries": [8, 16],  # kappa 1, 2 from micro-step 8, 4 from 16
    "verbose": 0,
}


def test_updates_to_target_interpolates_the_first_crossing():
    from keras_accum.experiments.schedules_report import updates_to_target

    points = [
        {"updates": u, "test_loss": v} for u, v in [(0, 3.0), (10, 2.0), (20, 1.0), (30, 2.0)]
    ]
    assert updates_to_target(points, 1.5) == 15.0  # half way from 2.0 at 10 to 1.0 at 20
    assert updates_to_target(points, 1.75) == 12.5
    assert updates_to_target(points, 3.0) == 0.0
    assert updates_to_target(points, 0.5) is None


def test_warmup_experiment(tmp_path):
    config = {**WARMUP, "data_dir": str(tmp_path / "tfds")}
    result = schedules_study.run_study(config, tmp_path / "out")
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "## Batch-size warmup to K = 4" in text and "| sqrt | piecewise |" in text
    assert (tmp_path / "out" / "warmup_lr_0.01.png").exists()
    ones = curve(result.rows, "warmup", "fixed_beta_1", "kappa=1")
    assert [r["test_loss"] for r in curve(result.rows, "warmup", "sqrt", "kappa=1").values()] == [
        r["test_loss"] for r in ones.values()
    ]  # one kappa=1 run, shared
    for method in ("fixed_beta_1", "sqrt"):
        constant = curve(result.rows, "warmup", method, "kappa=4")
        piecewise = curve(result.rows, "warmup", method, "piecewise")
        assert constant[256]["updates"] == 32 // 4
        assert piecewise[256]["updates"] == 8 + 8 // 2 + 16 // 4
        assert [piecewise[e]["kappa"] for e in (32, 96, 160)] == [1, 2, 4]
        adaptive = [r["kappa"] for r in curve(result.rows, "warmup", method, "adaptive").values()]
        assert adaptive == sorted(adaptive) and set(adaptive) <= {1, 2, 4}
    # The kappa=1 run reaches its own final loss (one seed: T) by its end.
    from keras_accum.experiments.schedules_report import updates_to_target, warmup_summary

    (target, _), entries = warmup_summary(result.rows, result.config, 1e-2)
    assert target == ones[256]["test_loss"]
    points = [ones[e] for e in sorted(ones)]
    assert entries[0]["to_target"] == [updates_to_target(points, target)]
    assert 0 < entries[0]["to_target"][0] <= 32
    for bad, match in [
        ({"warmup_kappa": 3}, "power of two"),
        ({"warmup_boundaries": [8]}, "= 2 increasing multiples of 4 micro-steps"),
        ({"warmup_boundaries": [8, 18]}, "multiples of 4"),
        (
            {"adaptive_kwargs": {"smoothin": 0.9}},
            r"adaptive_kwargs=\{'smoothin': 0.9\}: .*'smoothin'",
        ),
        ({"adaptive_kwargs": {"min_observations": 0}}, "Received: min_observations=0"),
    ]:
        with pytest.raises(cfg.ConfigError, match=match):
            schedules_study.resolve_config({**WARMUP, **bad})


# -- the character-level LM --------------------------------------------------


def test_char_corpus_is_deterministic_and_shifted():
    from keras_accum.experiments import charlm

    assert charlm.make_corpus(500, seed=0) == charlm.make_corpus(500, seed=0)
    assert charlm.make_corpus(500, seed=0) != charlm.make_corpus(500, seed=1)
    x, y = charlm.make_sequences("test")
    assert x.shape == y.shape == (charlm.SEQUENCES["test"], charlm.SEQ_LEN)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is the next character
    assert x.min() >= 0 and x.max() < charlm.VOCAB_SIZE


def test_char_lm_is_causal():
    from keras_accum.experiments import charlm

    model = charlm.build_lm()
    x, _ = charlm.make_sequences("test")
    changed = x[:2].copy()
    changed[:, 40:] = (changed[:, 40:] + 1) % charlm.VOCAB_SIZE
    a, b = model(x[:2]).numpy(), model(changed).numpy()
    np.testing.assert_allclose(a[:, :40], b[:, :40], rtol=1e-5, atol=1e-6)
    assert np.abs(a[:, 40:] - b[:, 40:]).max() > 1e-3


# -- runs from a config (keras_accum.experiments.experiment) -----------------


def test_config_takes_a_schedule(tmp_path):
    base = {"steps": 4, "steps_boundaries": [20], "steps_values": [1, 4]}
    config = experiment.resolve_config({**base, "scaling_rule": "power"})
    opt = experiment.make_optimizer(config, kappa=4, total_updates=10)
    assert isinstance(opt, ka.InvariantAdam) and opt.scaling_rule == "power"
    assert opt.steps.get_config() == {"boundaries": [20], "values": [1, 4]}
    assert opt.learning_rate.numpy() == np.float32(config["learning_rate"])  # unscaled
    # Flags spell the lists comma-separated.
    field = {f.name: f for f in run_config.FIELDS}["steps_values"]
    assert field.parse("1,4,16") == [1, 4, 16]
    for bad, match in [
        ({"steps_values": [1, 4]}, "both"),
        ({**base, "steps": 8}, "largest window 4"),
        ({**base, "steps_values": [1, 0]}, "values"),
        ({**base, "scaling_rule": "sqrt"}, "only optimizer='invariant_adam'"),
        ({**base, "scaling_rule": "invariant", "optimizer": "gradient_accumulation"}, "only"),
        ({**base, "lr_schedule": "cosine"}, "needs a scaling_rule"),
        ({**base, "strategy": "multi_worker"}, "constant `steps`"),
    ]:
        with pytest.raises(cfg.ConfigError, match=match):
            experiment.resolve_config(bad)


def test_train_and_evaluate_with_a_schedule(tmp_path):
    config = {
        "dataset": "mnist1d",
        "data_dir": str(tmp_path / "tfds"),
        "model": "mlp",
        "micro_batch_size": 50,
        "steps": 4,
        "steps_boundaries": [30],
        "steps_values": [1, 4],
        "scaling_rule": "invariant",
        "epochs": 1,
        "verbose": 0,
    }
    final = experiment.train_and_evaluate(config, tmp_path / "run")
    # 4000 examples = 20 windows of 4 x 50 = 80 micro-batches: 30 windows
    # of 1, then (80 - 30) / 4 = 12.5 windows of 4: 12 whole ones.
    assert final["updates"] == 30 + 12
    assert np.isfinite(final["test_loss"])
