"""The bounded mapping behind per-query and per-session memory (pure)."""

from services.shared.recent import Recent


def test_the_least_recently_put_key_goes_first() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.put("a", 3)  # "a" is now the most recent
    recent.put("c", 4)
    assert "b" not in recent and len(recent) == 2
    assert recent.items() == [("a", 3), ("c", 4)]
    assert recent.get("a") == 3 and recent.get("b") is None


def test_a_key_taken_out_is_gone() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    assert recent.pop("a") == 1 and recent.pop("a") is None and len(recent) == 0


def test_a_value_replaced_keeps_its_place() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.replace("a", 3)  # not a use: "a" is still the least recent
    recent.replace("z", 9)  # not kept: stays out
    recent.put("c", 4)
    assert recent.items() == [("b", 2), ("c", 4)]
