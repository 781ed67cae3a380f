"""PiecewiseSteps(ramp=...): a switch through the integers between its
values, the same as the explicit PiecewiseSteps of every step (issue #42)."""

import keras
import numpy as np
import pytest
from test_schedules import MAKERS, fit

import keras_accum as ka


def test_ramp_is_the_explicit_schedule_of_every_step():
    ramped = ka.PiecewiseSteps([512], [1, 4], ramp=128)
    explicit = ka.PiecewiseSteps([512, 576, 640], [1, 2, 3, 4])
    assert ramped.micro_step_boundaries == [512, 576, 640]
    for s in (0, 511, 512, 575, 576, 639, 640, 3000):
        assert int(ramped(s)) == int(explicit(s))
    assert (ramped.min_steps, ramped.max_steps) == (1, 4)


def test_ramp_between_neighbours_and_downwards():
    # 1 -> 2 has no integer between: the ramp leaves it at its boundary.
    assert ka.PiecewiseSteps([4, 10], [1, 2, 4], ramp=4).micro_step_boundaries == [4, 10, 14]
    # 4 -> 1: 3 at the boundary, 2 at +ramp/2, 1 at +ramp.
    down = ka.PiecewiseSteps([8], [4, 1], ramp=6)
    assert [int(down(s)) for s in (7, 8, 11, 14)] == [4, 3, 2, 1]


def test_ramp_in_examples_is_the_ramp_in_micro_steps():
    examples = ka.PiecewiseSteps([8192], [1, 4], unit="examples", micro_batch_size=16, ramp=2048)
    assert examples.micro_step_boundaries == [512, 576, 640]


def test_ramp_config_round_trip_and_old_configs():
    ramped = ka.PiecewiseSteps([8], [1, 4], ramp=4)
    assert ramped.get_config() == {"boundaries": [8], "values": [1, 4], "ramp": 4}
    again = ka.PiecewiseSteps.from_config(ramped.get_config())
    assert again.micro_step_boundaries == ramped.micro_step_boundaries == [8, 10, 12]
    assert "ramp" not in ka.PiecewiseSteps([8], [1, 4]).get_config()
    assert repr(ramped) == "PiecewiseSteps(boundaries=[8], values=[1, 4], ramp=4)"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ramp": -1}, "`ramp` must be an integer >= 0. Received: ramp=-1"),
        ({"ramp": 2.5}, "`ramp` must be an integer >= 0"),
        ({"ramp": True}, "`ramp` must be an integer >= 0"),
        ({"ramp": 8}, "`ramp` must end each switch before the next boundary"),
        ({"boundaries": [4], "values": [1, 8], "ramp": 3}, "both switch at micro-step 4"),
    ],
)
def test_ramp_refuses_bad_arguments_in_one_line(kwargs, message):
    args = {"boundaries": [4, 12], "values": [1, 4, 8], **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        ka.PiecewiseSteps(**args)
    assert "\n" not in str(e.value)


def test_adaptive_warmup_with_a_ramp_hands_over_at_its_end():
    warmup = ka.PiecewiseSteps([4], [1, 4], ramp=4)
    steps = ka.AdaptiveSteps(1, 8, 16, warmup=warmup)
    ka.InvariantAdam(0.01, steps=steps).build([keras.Variable(np.zeros(2, "float32"))])
    # 2 from micro-step 4, 3 from 6, then the adaptive part from 8 (the last step).
    assert [int(steps(s)) for s in range(10)] == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("name", ["invariant_adam_fixed_beta_1_ema", "gradient_accumulation"])
def test_ramp_trains_the_same_model_as_the_explicit_schedule(name):
    ramped = fit(lambda: MAKERS[name](ka.PiecewiseSteps([4], [1, 4], ramp=4)), 4)
    explicit = fit(lambda: MAKERS[name](ka.PiecewiseSteps([4, 6, 8], [1, 2, 3, 4])), 4)
    assert int(ramped.optimizer.iterations) == int(explicit.optimizer.iterations)
    for a, b in zip(ramped.get_weights(), explicit.get_weights()):
        np.testing.assert_array_equal(a, b)
