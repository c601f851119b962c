"""The cache of converted media (gateway/conversions.py): an LRU bounded in bytes, counted."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.conversions import ENTRY_OVERHEAD, ConversionCache
from gateway.metrics import GatewayMetrics


def cache(max_bytes: int) -> tuple[ConversionCache, CollectorRegistry]:
    registry = CollectorRegistry()
    return ConversionCache(max_bytes, GatewayMetrics(registry)), registry


def test_the_least_recently_used_go_first_when_the_bytes_run_out() -> None:
    c, registry = cache(3 * (100 + ENTRY_OVERHEAD))
    for name in "abc":
        c.put(("frames", name), name.upper(), 100)
    assert c.get(("frames", "a")) == "A"  # now the most recently used
    c.put(("frames", "d"), "D", 100)
    assert [c.get(("frames", n)) for n in "abcd"] == ["A", None, "C", "D"]
    assert c.size == 3 * (100 + ENTRY_OVERHEAD) and len(c) == 3
    sample = registry.get_sample_value
    assert sample("gateway_media_cache_requests_total", {"kind": "frames", "result": "hit"}) == 4
    assert sample("gateway_media_cache_requests_total", {"kind": "frames", "result": "miss"}) == 1
    assert sample("gateway_media_cache_bytes") == c.size


def test_a_value_larger_than_the_cache_is_not_kept_and_a_key_put_again_replaces_its_value() -> None:
    c, _ = cache(1000)
    c.put(("transcript", "x"), "small", 10)
    c.put(("transcript", "huge"), "H", 5000)
    assert c.get(("transcript", "huge")) is None and c.get(("transcript", "x")) == "small"
    c.put(("transcript", "x"), "again", 20)
    assert c.get(("transcript", "x")) == "again" and c.size == 20 + ENTRY_OVERHEAD


def test_resizing_evicts_and_zero_keeps_nothing() -> None:
    c, registry = cache(10_000)
    for i in range(5):
        c.put(("presample", i), i, 1000)
    c.resize(2 * (1000 + ENTRY_OVERHEAD))
    assert len(c) == 2 and c.get(("presample", 4)) == 4 and c.get(("presample", 0)) is None
    c.resize(0)
    assert len(c) == 0 and c.size == 0 and registry.get_sample_value("gateway_media_cache_bytes") == 0
    assert not c.enabled  # callers skip hashing and looking up
    c.put(("presample", 9), 9, 1)
    assert c.get(("presample", 9)) is None
