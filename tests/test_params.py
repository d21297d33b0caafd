"""The one generation-parameters value: checked when made, filled source by source."""

from __future__ import annotations

import math

import pytest

from sfchat.config import RULES, Settings, gen_params, given_params
from sfchat.params import BOUNDS, BUILT_IN, Ask, GenParams


def test_each_none_is_filled_from_the_next_source():
    asked = GenParams(temperature=0.5, seed=3)
    settings = GenParams(temperature=1.0, top_k=40)
    model = GenParams(top_p=0.9, repetition_penalty=1.1, top_k=20)
    assert asked.over(settings).over(model).over(BUILT_IN) == GenParams(0.5, 40, 0.9, 1.1, 3)
    assert GenParams().over(BUILT_IN) == BUILT_IN and BUILT_IN.seed is None
    assert asked.given() == {"temperature": 0.5, "seed": 3}


@pytest.mark.parametrize("values", [
    {"temperature": 2.5}, {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": True},
    {"top_k": -1}, {"top_k": 2.0}, {"top_k": (1 << 20) + 1}, {"top_p": 0.0}, {"top_p": 1.5},
    {"repetition_penalty": 0.0}, {"repetition_penalty": math.inf}, {"seed": 1 << 64}, {"seed": "1"},
])
def test_a_value_out_of_its_bounds_is_refused_when_made(values):
    with pytest.raises(ValueError, match=next(iter(values))):
        GenParams(**values)


def test_a_whole_number_is_taken_for_a_float():
    g = GenParams(temperature=1, top_p=1, repetition_penalty=2)
    assert (type(g.temperature), type(g.top_p), type(g.repetition_penalty)) == (float, float, float)


def test_the_settings_check_the_same_bounds():
    for name, bound in BOUNDS.items():
        rule = RULES[name]
        assert (rule.kind, rule.lo, rule.hi, rule.above) == (bound.kind, bound.lo, bound.hi, bound.above)


def test_a_chat_screen_asks_with_the_settings_the_user_chose():
    s = Settings(max_new_tokens=64, temperature=0.7, seed=5)
    assert gen_params(s) == GenParams(temperature=0.7, seed=5)
    assert given_params(s) == Ask(64, GenParams(temperature=0.7, seed=5))
    assert given_params(Settings()) == Ask()
