"""AdaptiveSteps: the smoothed, settled, never-decreasing rule against a
numpy reference, the warmup handover through an optimizer, save/load of its
state mid-run, determinism, and its argument checks."""

import math

import keras
import numpy as np
import pytest
import references
import tensorflow as tf
from conftest import ends_mid_window
from test_fit_and_saving import X, Y, build_model

import keras_accum as ka
from keras_accum import schedules, sharpness

NAN, INF = float("nan"), float("inf")


def built(schedule):
    opt = ka.InvariantAdam(0.01, steps=schedule, scaling_rule="power")
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    return opt


ESTIMATES = [NAN, 900.0, 40.0, INF, NAN, 10.0, -5.0, -INF, 70.0, 20.0, 1e9, 64.0, 100.0]


@pytest.mark.parametrize("smoothing, settle", [(0.9, 4), (0.0, 1), (0.5, 2), (0.99, 6)])
def test_observe_matches_the_reference(smoothing, settle):
    schedule = ka.AdaptiveSteps(2, 8, 32, smoothing=smoothing, min_observations=settle)
    built(schedule)
    expected = references.adaptive_steps(ESTIMATES, 2, 8, 32, smoothing, settle, first=2)
    for b, (smoothed, n, steps) in zip(ESTIMATES, expected):
        before = int(schedule.steps), int(schedule.observations)
        assert int(schedule.propose(b)) == steps  # the reference, no state change
        assert (int(schedule.steps), int(schedule.observations)) == before
        assert int(schedule.observe(b)) == steps
        decision = schedule.decisions[-1]
        np.testing.assert_allclose(decision.smoothed, smoothed, rtol=1e-12)
        assert (decision.observations, decision.steps) == (n, steps)
        assert decision.reason == ("decided" if n >= settle else "settling")
        assert decision.b_simple == b or math.isnan(b)
    smoothed, n, steps = expected[-1]
    assert (int(schedule.steps), int(schedule.observations)) == (steps, n)
    np.testing.assert_allclose(float(schedule.smoothed), smoothed, rtol=1e-12)


def test_powers_of_two_round_the_decided_size_up():
    schedule = ka.AdaptiveSteps(2, 16, 32, smoothing=0.5, min_observations=2, powers_of_two=True)
    built(schedule)
    estimates = ESTIMATES + [200.0, 300.0, 2000.0]
    expected = references.adaptive_steps(estimates, 2, 16, 32, 0.5, 2, first=2, pow2=True)
    sizes = [int(schedule.observe(b)) for b in estimates]
    assert sizes == [steps for _, _, steps in expected]
    assert set(sizes) <= {2, 4, 8, 16} and len(set(sizes)) > 2
    assert schedule.get_config()["powers_of_two"] is True


def test_defaults_wait_for_four_estimates():
    # A first probe of 1000 (kappa 32 alone) no longer decides by itself.
    schedule = ka.AdaptiveSteps(1, 16, 32)
    assert (schedule.smoothing, schedule.min_observations) == (0.9, 4)
    built(schedule)
    sizes = [int(schedule.observe(b)) for b in (1000.0, 40.0, NAN, 50.0, 30.0)]
    # 1000 enters as 512 (16 x 32); B_4 = 139.8 after the four finite ones.
    assert sizes == [1, 1, 1, 1, 5]
    assert [d.reason for d in schedule.decisions] == ["settling"] * 4 + ["decided"]


def window_starts(opt, schedule, observations, micro_batches):
    """Applies `micro_batches` gradients in one tf.function, observing
    `observations[s]` before micro-step s; returns {start: size} and the
    trace count. Checks that a window keeps its size until it ends."""
    var = keras.Variable(np.zeros(3, "float32"))
    opt.build([var])
    step = tf.function(lambda g: opt.apply([g], [var]))
    starts, end = {}, 0
    for s in range(micro_batches):
        for b in observations.get(s, []):
            schedule.observe(b)
        size_before = int(opt.window_steps)
        step(tf.ones(3))
        if s >= end:
            starts[s] = int(opt.window_steps)
            end = s + starts[s]
        else:
            assert int(opt.window_steps) == size_before
    return starts, step.experimental_get_tracing_count()


@pytest.mark.parametrize(
    "estimate, starts",
    [
        # Decided 2 in the warmup: its last value, 4, holds from the handover.
        (20.0, {8: 4, 12: 6, 18: 6}),
        # Decided 7 in the warmup; 8 from the window after the one in progress.
        (100.0, {8: 7, 15: 8}),
    ],
)
def test_warmup_hands_over_at_its_last_boundary(estimate, starts):
    warmup = ka.PiecewiseSteps([4, 7], [1, 2, 4])
    schedule = ka.AdaptiveSteps(1, 8, 16, smoothing=0.5, min_observations=2, warmup=warmup)
    assert schedules.steps_range(schedule) == (1, 8)
    opt = ka.InvariantAdam(0.01, steps=schedule, scaling_rule="power")
    # Settled at micro-step 2, inside the warmup; 1e6 (clipped to 128) at 9,
    # inside the first window after the handover.
    found, traces = window_starts(opt, schedule, {1: [estimate], 2: [estimate], 9: [1e6]}, 20)
    # The window starting at 6 crosses the handover at 7 with its size, 2.
    assert found == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 6: 2, **starts}
    assert traces == 1
    assert [d.reason for d in schedule.decisions] == ["warmup", "warmup", "decided"]
    assert [d.steps for d in schedule.decisions] == [1, 1, list(starts.values())[-1]]


def test_value_in_xla_follows_the_variables():
    schedule = ka.AdaptiveSteps(1, 8, 16, 0.0, 1, warmup=ka.PiecewiseSteps([3], [2, 4]))
    built(schedule)
    value = tf.function(lambda s: schedule(s), jit_compile=True)
    assert [int(value(tf.constant(s, "int64"))) for s in range(5)] == [2, 2, 2, 4, 4]
    schedule.observe(100.0)  # ceil(100 / 16) = 7 from the handover
    assert [int(value(tf.constant(s, "int64"))) for s in range(5)] == [2, 2, 2, 7, 7]
    assert value.experimental_get_tracing_count() == 1


# Micro-batches of 4 over 24 examples x 2; (fit up to micro-step, then
# observe). Windows: 0, 1 (warmup), 2-3, 4-5 (2, unsettled), 6-8 (3),
# 9-12, 13-16, 17-20 (4).
PLAN = [(1, [3.0]), (3, [NAN, 9.0]), (5, [10.0]), (8, [INF]), (21, [])]
SAVED_AFTER = 1  # micro-step 3: inside a window, two of three estimates


@ends_mid_window
def test_state_is_saved_and_restored_mid_run(tmp_path):
    x, y = np.concatenate([X, X]), np.concatenate([Y, Y])

    def run(model, plan):
        done = int(model.optimizer.micro_step)
        for until, estimates in plan:
            model.fit(
                x[4 * done : 4 * until],
                y[4 * done : 4 * until],
                batch_size=4,
                shuffle=False,
                verbose=0,
            )
            for b in estimates:
                model.optimizer.steps.observe(b)
            done = until

    model = build_model()
    steps = ka.AdaptiveSteps(1, 4, 4, 0.5, 3, warmup=ka.PiecewiseSteps([2], [1, 2]))
    model.compile(optimizer=ka.InvariantAdam(0.01, steps=steps, scaling_rule="power"), loss="mse")
    run(model, PLAN[: SAVED_AFTER + 1])
    path = str(tmp_path / "adaptive.keras")
    model.save(path)
    saved_state = [v.numpy() for v in model.optimizer.variables]
    run(model, PLAN[SAVED_AFTER + 1 :])
    decided = [d.steps for d in steps.decisions]
    assert decided == [1, 2, 2, 3, 4] and int(model.optimizer.iterations) == 8

    restored = keras.models.load_model(path)
    schedule = restored.optimizer.steps
    assert schedule.get_config() == steps.get_config()
    assert (int(schedule.observations), int(schedule.steps)) == (2, 2)
    for a, b in zip(restored.optimizer.variables, saved_state):
        np.testing.assert_array_equal(a.numpy(), b)
    run(restored, PLAN[SAVED_AFTER + 1 :])
    np.testing.assert_equal(schedule.decisions, steps.decisions[3:])
    for a, b in zip(restored.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_same_estimates_give_the_same_decisions():
    def make():
        schedule = ka.AdaptiveSteps(1, 8, 32, smoothing=0.8, min_observations=3)
        return schedule, built(schedule)

    (first, _), (second, _), (traced, _) = make(), make(), make()
    observe = tf.function(traced.observe)
    for b in ESTIMATES:
        size = int(first.observe(b))
        assert int(second.observe(b)) == size == int(observe(tf.constant(b)))
    np.testing.assert_equal(first.decisions, second.decisions)
    assert traced.decisions == []  # records are eager only
    for a, b in ((first, second), (first, traced)):
        assert int(a.steps) == int(b.steps) and int(a.observations) == int(b.observations)
        assert float(a.smoothed) == float(b.smoothed)


def test_config_and_bounds_cover_the_warmup():
    warmup = ka.PiecewiseSteps([4], [1, 2])
    schedule = ka.AdaptiveSteps(3, 8, 16, smoothing=0.0, min_observations=2, warmup=warmup)
    assert (schedule.min_steps, schedule.max_steps) == (1, 8)
    config = schedule.get_config()
    assert config["min_steps"] == 3 and config["warmup"]["config"] == warmup.get_config()
    clone = ka.AdaptiveSteps.from_config(config)
    assert (
        repr(clone)
        == repr(schedule)
        == (
            "AdaptiveSteps(min_steps=3, max_steps=8, micro_batch_size=16, smoothing=0.0, "
            "min_observations=2, warmup=PiecewiseSteps(boundaries=[4], values=[1, 2]), "
            "powers_of_two=False)"
        )
    )
    opt = built(clone)
    assert int(clone.steps) == 3  # from the handover: max(3, warmup's last 2)
    assert int(opt.steps(0)) == 1 and int(opt.steps(4)) == 3
    assert schedules.steps_range(clone) == (1, 8)


@pytest.mark.parametrize(
    "name, kwargs, echo",
    [
        ("smoothing", {"smoothing": 1.0}, "smoothing=1.0"),
        ("smoothing", {"smoothing": -0.1}, "smoothing=-0.1"),
        ("smoothing", {"smoothing": NAN}, "smoothing=nan"),
        ("smoothing", {"smoothing": "0.9"}, "smoothing='0.9'"),
        ("smoothing", {"smoothing": True}, "smoothing=True"),
        ("min_observations", {"min_observations": 0}, "min_observations=0"),
        ("min_observations", {"min_observations": 2.0}, "min_observations=2.0"),
        ("min_observations", {"min_observations": None}, "min_observations=None"),
        ("warmup", {"warmup": [1, 2]}, "warmup=[1, 2]"),
        ("warmup", {"warmup": 4}, "warmup=4"),
        ("warmup", {"warmup": ka.PiecewiseSteps([], [2])}, "boundaries=[], values=[2]"),
        ("warmup", {"warmup": ka.PiecewiseSteps([4], [2, 16])}, "max_steps=8"),
        ("min_steps", {"min_steps": 0}, "min_steps=0"),
        ("micro_batch_size", {"micro_batch_size": 0.5}, "micro_batch_size=0.5"),
        ("max_steps", {"min_steps": 9}, "min_steps=9, max_steps=8"),
        ("powers_of_two", {"powers_of_two": 1}, "powers_of_two=1"),
        ("min_steps", {"powers_of_two": True, "min_steps": 3}, "min_steps=3, max_steps=8"),
        ("max_steps", {"powers_of_two": True, "max_steps": 12}, "min_steps=1, max_steps=12"),
    ],
)
def test_refuses_bad_arguments(name, kwargs, echo):
    with pytest.raises(ValueError) as raised:
        ka.AdaptiveSteps(**{"max_steps": 8, **kwargs})
    message = str(raised.value)
    assert "\n" not in message and f"`{name}`" in message and echo in message, message


def test_lives_in_adaptive_steps_only():
    # keras_accum.schedules was its home in 0.2.0; the alias that looked it
    # up there on use closed an import circle and is gone (CHANGELOG).
    from keras_accum import adaptive_steps, schedules

    assert ka.AdaptiveSteps is adaptive_steps.AdaptiveSteps
    assert ka.AdaptiveSteps.__module__ == "keras_accum.adaptive_steps"
    assert not hasattr(schedules, "AdaptiveSteps")
    # A config written while it lived in schedules still loads: Keras finds
    # the class by its registered name, not by the module recorded.
    config = keras.saving.serialize_keras_object(ka.AdaptiveSteps(1, 8, 32))
    loaded = keras.saving.deserialize_keras_object({**config, "module": "keras_accum.schedules"})
    assert type(loaded) is ka.AdaptiveSteps and loaded.get_config() == config["config"]


def test_a_config_saved_by_0_2_0_loads_its_own_rule_and_says_so():
    # 0.2.0 saved min_steps, max_steps and micro_batch_size only; its rule
    # took each estimate as it came (smoothing 0, a decision from the first).
    old = {"min_steps": 1, "max_steps": 8, "micro_batch_size": 32}
    with pytest.warns(
        UserWarning,
        match=r"0\.2\.0.*smoothing=0\.0, min_observations=1.*"
        r"now smoothing=0\.9, min_observations=4",
    ):
        loaded = ka.AdaptiveSteps.from_config(old)
    assert (loaded.smoothing, loaded.min_observations) == (0.0, 1)
    defaults = ka.AdaptiveSteps()
    assert (defaults.smoothing, defaults.min_observations) == (0.9, 4)


def test_a_current_config_loads_without_a_warning(recwarn):
    config = ka.AdaptiveSteps(2, 8, 16, smoothing=0.5).get_config()
    loaded = ka.AdaptiveSteps.from_config(config)
    assert loaded.get_config() == config
    assert not [w for w in recwarn.list if "0.2.0" in str(w.message)]


# -- the pluggable noise-scale estimate -----------------------------------------


@keras.saving.register_keras_serializable(package="keras_accum_tests")
def halved_norm(optimizer):
    """A noise-estimate factory: half the Euclidean squared norm."""
    del optimizer
    return lambda grads: 0.5 * ka.diagnostics.squared_norm(grads)


def test_noise_estimate_default_and_round_trip():
    assert ka.AdaptiveSteps().noise_estimate == "b_simple"
    for estimate in ("b_simple", "adam_preconditioned", halved_norm):
        schedule = ka.AdaptiveSteps(1, 8, 16, noise_estimate=estimate)
        config = schedule.get_config()
        clone = ka.AdaptiveSteps.from_config(config)
        assert clone.get_config() == config
        assert (clone.noise_estimate is halved_norm) or clone.noise_estimate == estimate
        assert repr(clone) == repr(schedule)
    # A config saved before the argument existed loads with the default.
    old = ka.AdaptiveSteps(1, 8, 16).get_config()
    del old["noise_estimate"]
    assert ka.AdaptiveSteps.from_config(old).noise_estimate == "b_simple"


@pytest.mark.parametrize("bad", ["adam", 3])
def test_noise_estimate_refuses_unknown_names(bad):
    with pytest.raises(ValueError, match="noise_estimate"):
        ka.AdaptiveSteps(1, 8, 16, noise_estimate=bad)


def _micro_grads(rng, shapes, kappa):
    return [[tf.constant(rng.normal(size=s), tf.float32) for s in shapes] for _ in range(kappa)]


def test_adam_preconditioned_estimate_is_b_simple_in_the_whitened_norm():
    """sum g^2 / (sqrt(v_hat) + eps) with the optimizer's v: B_simple of
    the gradients divided by sqrt(sqrt(v_hat) + eps), and the plain B_simple
    before any update (v = 0: uniform weights)."""
    rng = np.random.default_rng(0)
    shapes = [(3, 2), (2,)]
    variables = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
    schedule = ka.AdaptiveSteps(1, 8, 4, noise_estimate="adam_preconditioned")
    opt = ka.InvariantAdam(0.01, steps=schedule, scaling_rule="fixed_beta_1")
    opt.build(variables)
    micro = _micro_grads(rng, shapes, 4)

    def b_simple(tracker, grads):
        tracker.update_from_micro_grads(grads, 4)
        return float(tracker.b_simple)

    plain = b_simple(ka.diagnostics.GradientNoiseScale(0.0), micro)
    assert b_simple(schedule.noise_tracker(0.0), micro) == pytest.approx(plain, rel=1e-5)
    for _ in range(3):  # v from three updates
        opt.apply([tf.constant(rng.normal(size=s) * 3, tf.float32) for s in shapes], variables)
    scales = sharpness.adam_preconditioner(opt)  # 1 / sqrt(sqrt(v_hat) + eps)
    whitened = [[g * p for g, p in zip(grads, scales)] for grads in micro]
    expected = b_simple(ka.diagnostics.GradientNoiseScale(0.0), whitened)
    got = b_simple(schedule.noise_tracker(0.0), micro)
    assert got == pytest.approx(expected, rel=1e-4)
    assert got != pytest.approx(plain, rel=1e-2)  # the norm matters here
