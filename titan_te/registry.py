"""One tiny registry type shared by every pluggable component (models, backends, optimizers, ...)."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def reading(*options: str) -> Callable[[T], T]:
    """Mark a registered function or class with the options of its config section that it reads, of those that
    only some components read (e.g. data.path: the files, tokens and hf datasets). The config refuses such an
    option when the chosen component would ignore it, and --help lists who reads each."""
    def mark(obj: T) -> T:
        obj.reads = options  # type: ignore[attr-defined]
        return obj

    return mark


class RegistryError(KeyError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise RegistryError(self.miss_message(name))
        return self._items[name]

    def miss_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown {self.kind} '{name}'{hint}; valid: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
