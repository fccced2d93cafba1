from dataclasses import dataclass

from asyncgrpo.train.staleness import is_stale, split_stale, staleness


@dataclass
class S:
    name: str
    model_version: int


def test_a_sample_exactly_max_staleness_behind_is_still_trained():
    assert staleness(model_version=3, current_version=7) == 4
    assert not is_stale(3, 7, max_staleness=4)
    assert is_stale(2, 7, max_staleness=4)
    assert not is_stale(7, 7, max_staleness=0) and is_stale(6, 7, max_staleness=0)


def test_split_keeps_order():
    samples = [S("a", 5), S("b", 1), S("c", 4), S("d", 0), S("e", 6)]
    fresh, stale = split_stale(samples, current_version=6, max_staleness=2)
    assert [s.name for s in fresh] == ["a", "c", "e"]
    assert [s.name for s in stale] == ["b", "d"]


def test_split_with_a_custom_version_reader():
    fresh, stale = split_stale([(0, "x"), (3, "y")], 3, 1, version_of=lambda pair: pair[0])
    assert fresh == [(3, "y")] and stale == [(0, "x")]
