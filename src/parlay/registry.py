"""One registry shape for every pluggable kind: compressors, consistency policies, pipeline
schedules and Trainer modes.

A new compressor, policy, schedule or mode is one class plus one ``register`` call on the
:class:`Registry` of its kind; the lookup, the list of valid names, the "unknown X" error (with
a close-match hint) and the ``"name:options"`` spelling are the same for all of them. Each kind
has exactly one registry (:func:`registries` lists them), so generic tests can enumerate every
kind and a newcomer inherits them.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from parlay.errors import ConfigError

__all__ = ["Registry", "registries", "split_spec"]

T = TypeVar("T")

_ALL: dict[str, Registry[Any]] = {}


def split_spec(spec: str) -> tuple[str, list[str]]:
    """Split a ``"name:options"`` string into the lower-cased name and its option strings.

    Options are comma-separated and kept as written (``"k=v"`` pairs included), for the
    entry's factory to interpret: ``"topk:0.01,momentum=0.9"`` gives
    ``("topk", ["0.01", "momentum=0.9"])``, ``"stale:2"`` gives ``("stale", ["2"])`` and
    ``"sync"`` gives ``("sync", [])``.

    Args:
        spec: The spelling, e.g. from a command line or a config file.

    Returns:
        ``(name, options)``.

    Raises:
        ConfigError: ``spec`` is not a string.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"expected a 'name' or 'name:options' string, got "
                          f"{type(spec).__name__} {spec!r}.")
    name, _, opts = spec.strip().partition(":")
    return name.strip().lower(), [a.strip() for a in opts.split(",") if a.strip()]


class Registry(Generic[T]):
    """Named entries of one kind (factories, or specs such as a pipeline schedule's).

    Args:
        kind: What the entries are, as the error message names them (``"compression"``,
            ``"pipeline schedule"``, ...). One registry per kind: a second raises.
        valid: Label of the list of valid names in the error (``"valid names"``).
        example: Spelling hint appended to the error, e.g. ``"e.g. 'topk:0.01'"``.
        normalize: Maps a name to its key (default: lower case), e.g. to ignore dashes.
        load: Called as ``load(key)`` when a name is missing and ``load(None)`` before the
            names are listed; it may register entries (e.g. import built-in modules lazily).

    Raises:
        ConfigError: A registry of ``kind`` exists already.
    """

    def __init__(self, kind: str, *, valid: str = "valid", example: str = "",
                 normalize: Callable[[str], str] = str.lower,
                 load: Callable[[str | None], None] | None = None) -> None:
        if kind in _ALL:
            raise ConfigError(f"a registry of {kind!r} exists already: expected one registry "
                              "per kind. Hint: register into parlay.registry.registries()"
                              f"[{kind!r}] instead of creating another.")
        self.kind, self.valid, self.example = kind, valid, example
        self._normalize = normalize
        #: The lazy loader (see ``load`` above); a package may set it after building the table.
        self.load = load
        self._entries: dict[str, T] = {}
        _ALL[kind] = self

    def key(self, name: str) -> str:
        """The key ``name`` is stored under (after ``normalize``)."""
        return self._normalize(str(name).strip())

    def register(self, name: str, entry: T, *, replace: bool = False) -> None:
        """Register ``entry`` under ``name``.

        Raises:
            ConfigError: ``name`` holds another entry already (a built-in, say) and ``replace``
                is false.
        """
        key = self.key(name)
        held = self._entries.get(key, entry)
        if held is not entry and not replace:
            raise ConfigError(f"{self.kind} {name!r} is registered already ({held!r}). Hint: "
                              "register yours under another name, or pass replace=True to "
                              "replace it.")
        self._entries[key] = entry

    def available(self) -> list[str]:
        """Every registered name, sorted."""
        if self.load is not None:
            self.load(None)
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.key(name) in self._entries

    def get(self, name: str, *, shown: str | None = None) -> T:
        """The entry registered as ``name``.

        Args:
            name: The name (without options: ``lookup`` takes ``"name:options"``).
            shown: What the user typed, for the error (default ``name``).

        Raises:
            ConfigError: Unknown name: the message names the kind, the bad name, every valid
                name and the closest one.
        """
        if shown is None and ":" in str(name):
            raise ConfigError(f"get() takes a bare {self.kind} name, got {name!r}. Hint: "
                              f"lookup({name!r}) returns the entry and its options.")
        key = self.key(name)
        if key not in self._entries and self.load is not None:
            self.load(key)
        if key not in self._entries:
            raise self.unknown(name if shown is None else shown, key)
        return self._entries[key]

    def lookup(self, spec: str) -> tuple[T, list[str]]:
        """Split ``"name:options"`` (:func:`split_spec`) and look the name up.

        Returns:
            ``(entry, options)``.

        Raises:
            ConfigError: Unknown name (the error quotes the whole ``spec``).
        """
        name, options = split_spec(spec)
        return self.get(name, shown=spec), options

    def unknown(self, shown: object, key: str | None = None) -> ConfigError:
        """The error for a name that is not registered.

        Args:
            shown: What the user typed.
            key: Its normalized name, for the close-match hint (default: from ``shown``).
        """
        names = self.available()
        if key is None:
            key = self.key(split_spec(shown)[0]) if isinstance(shown, str) else ""
        msg = f"unknown {self.kind} {shown!r}; {self.valid}: {', '.join(names)}"
        msg += f" ({self.example})." if self.example else "."
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if close:
            msg += f" Hint: did you mean {close[0]!r}?"
        return ConfigError(msg)


def registries() -> dict[str, Registry[Any]]:
    """Every registry created so far, by kind (a kind's module must have been imported)."""
    return dict(_ALL)
