"""The classes a saved folder may name, and the only places such a name is looked up.

Library classes are saved as ["pipelines", ClassName], never a module path, so they may move between modules;
the package face declares each name with the function importing its module, so a lookup imports one module and
an undeclared name imports none. A user's class (saved under its module path) resolves only once registered or
passed in: importing a module a folder names would run its code (`trust_remote_code=True` opts in)."""

from __future__ import annotations

from typing import Callable, Mapping

LIBRARY = "pipelines"
_CLASSES: dict[str, type] = {}
_USER_CLASSES: dict[tuple[str, str], type] = {}
_DECLARED: dict[str, Callable[[], object]] = {}  # library class name -> imports its module (the package face's)


def declare_library_classes(importers: Mapping[str, Callable[[], object]]) -> None:
    """Library class names, each with the function importing the module that registers it."""
    _DECLARED.update(importers)


def library_class(cls: type) -> type:
    """Class decorator: `cls` is saved as ["pipelines", cls.__name__] and resolved back by that name."""
    known = _CLASSES.get(cls.__name__)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"Two library classes are named {cls.__name__!r}: {known} and {cls}; rename one.")
    _CLASSES[cls.__name__] = cls
    return cls


def register_class(cls: type) -> type:
    """Allow folders to name `cls` as `[cls.__module__, cls.__name__]` (usable as a decorator); saving registers too."""
    if not isinstance(cls, type):
        raise TypeError(f"register_class takes a class, got {type(cls).__name__} {cls!r}.")
    _USER_CLASSES[(cls.__module__, cls.__name__)] = cls
    return cls


def find_library_class(class_name: str | None) -> type | None:
    name = class_name or ""
    if name not in _CLASSES and name in _DECLARED:
        _DECLARED[name]()  # importing its module registers it
    return _CLASSES.get(name)


def find_registered_class(module: str, class_name: str) -> type | None:
    return _USER_CLASSES.get((module, class_name))


def find_registered_named(class_name: str | None) -> type | None:
    """The one registered user class named `class_name`: diffusers writes a custom pipeline's `_class_name` without
    its module. None when no registered class, or several, have that name."""
    found = [cls for (_, name), cls in _USER_CLASSES.items() if name == class_name]
    return found[0] if len(found) == 1 else None


def is_library_class(cls: type) -> bool:
    return _CLASSES.get(cls.__name__) is cls
