import random

import pytest

from acelora import Residency


def test_lru_evicts_the_least_recently_used():
    r = Residency(capacity=2, policy="lru")
    assert r.access("a", 0).hit is False and r.access("b", 1).hit is False
    assert r.access("a", 2).hit is True
    res = r.access("c", 3)
    assert res.hit is False and res.evicted == ["b"] and set(r.resident) == {"a", "c"}


def test_lfu_keeps_the_frequently_used_adapter_through_a_scan():
    r = Residency(capacity=2, policy="lfu")
    for t in range(5):
        r.access("hot", t)
    for t, name in enumerate(["x", "y", "z"], start=10):
        r.access(name, t)
    assert "hot" in r


def test_forecast_lets_an_old_burst_fade_and_prewarms_what_is_rising():
    r = Residency(capacity=2, policy="forecast", half_life_s=10)
    for t in range(20):
        r.access("old-burst", t * 0.1)
    r.access("steady", 100)
    r.access("steady", 101)
    res = r.access("new", 102)
    assert res.evicted == ["old-burst"]  # 100 s later the burst is worth less than two recent requests
    assert r.access("rising", 103).evicted == ["new"]  # one fresh request < two a little older
    assert r.access("rising", 103.5).hit
    assert set(r.resident) == {"steady", "rising"}
    assert r.prewarm_candidates(104, 3) == ["new", "old-burst"]  # recent first; nothing resident
    assert r.prewarm_candidates(104, 1) == ["new"]


def test_forecast_beats_lru_on_skewed_traffic():
    rng = random.Random(0)
    names = [f"a{i}" for i in range(40)]
    weights = [1 / (i + 1) ** 1.2 for i in range(40)]  # Zipf-like popularity
    trace = rng.choices(names, weights, k=4000)
    rates = {}
    for policy in ("lru", "forecast"):
        r = Residency(capacity=8, policy=policy, half_life_s=200)
        for t, n in enumerate(trace):
            r.access(n, float(t))
        rates[policy] = r.hit_rate
    assert rates["forecast"] > rates["lru"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        Residency(capacity=0)
    with pytest.raises(ValueError):
        Residency(capacity=1, policy="mru")
