"""The classes a saved folder may name as `["pipelines", "ClassName"]`, by name.

A folder records the class of each component; for this library's own classes it records the library
("pipelines") and the class name, never a module path, so classes can move between modules without breaking
folders saved earlier. Each such class registers itself with `@library_class` where it is defined, and
`pipelines.import_library_classes()` imports every module that defines one.
"""

from __future__ import annotations

import importlib

LIBRARY = "pipelines"
_CLASSES: dict[str, type] = {}


def library_class(cls: type) -> type:
    """Class decorator: `cls` is saved as ["pipelines", cls.__name__] and resolved back by that name."""
    known = _CLASSES.get(cls.__name__)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"Two library classes are named {cls.__name__!r}: {known} and {cls}; rename one.")
    _CLASSES[cls.__name__] = cls
    return cls


def find_library_class(class_name: str | None) -> type | None:
    """The library class registered as `class_name` (None when there is none)."""
    importlib.import_module(LIBRARY).import_library_classes()  # registers every library class
    return _CLASSES.get(class_name or "")


def is_library_class(cls: type) -> bool:
    return _CLASSES.get(cls.__name__) is cls
