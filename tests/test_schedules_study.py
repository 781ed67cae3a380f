"""The batch-size schedules study: smoke run end to end, with the
properties its runs must have whatever the numbers."""

import pathlib

import numpy as np
import pytest

from keras_accum.experiments import experiment, schedules_study

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
