"""A mapping that keeps only the keys used most recently: memory a long-running
process holds per session or per query, without growing for ever."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    def __init__(self, size: int) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = size

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The value, if kept; reading it does not make it recent."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        """Keep the value as the most recent; the least recent goes past `size`."""
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self._size:
            self._items.popitem(last=False)

    def replace(self, key: K, value: V) -> None:
        """Change the value of a key kept, leaving its place: a change that is
        not a use. A key not kept stays out."""
        if key in self._items:
            self._items[key] = value

    def pop(self, key: K) -> V | None:
        """Take the value out, if kept."""
        return self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())
