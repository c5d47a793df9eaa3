"""The classes a saved folder may name, and the only places a class named by a folder is looked up.

A folder records the class of each component. For this library's own classes it records the library
("pipelines") and the class name, never a module path, so classes can move between modules without breaking
folders saved earlier: each registers itself with `@library_class` where it is defined. The modules that define
them sit above this one, so this registry never imports them: the package face (`pipelines/__init__.py`, which
runs before any `pipelines.x.y` can be imported) hands over, with `set_library_importer`, the function that
imports them all, and the first lookup of a library class calls it.

A user's own class is recorded under its module path (`["my_models.vae", "MyVAE"]`). Resolving such a name never
imports anything: the class must be registered with `pipelines.register_class(MyVAE)` (saving an instance
registers its class in the saving process), or passed to `from_pretrained`, because importing a module named by
a folder runs that module's code. `trust_remote_code=True` is the explicit opt-in that imports it anyway (see
`model_index.resolve_class`).
"""

from __future__ import annotations

from typing import Callable

LIBRARY = "pipelines"
_CLASSES: dict[str, type] = {}
_USER_CLASSES: dict[tuple[str, str], type] = {}
_IMPORTERS: list[Callable[[], None]] = []  # what registers every library class (set by the package face)


def set_library_importer(import_all: Callable[[], None]) -> None:
    """Register the function that imports every module defining a library class (run once, on first lookup)."""
    _IMPORTERS.append(import_all)


def library_class(cls: type) -> type:
    """Class decorator: `cls` is saved as ["pipelines", cls.__name__] and resolved back by that name."""
    known = _CLASSES.get(cls.__name__)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"Two library classes are named {cls.__name__!r}: {known} and {cls}; rename one.")
    _CLASSES[cls.__name__] = cls
    return cls


def register_class(cls: type) -> type:
    """Allow folders to name `cls` as `[cls.__module__, cls.__name__]` (usable as a decorator).

    Loading a folder resolves such names only through this registry: a folder can never make the library
    import a module. Register your own model, scheduler or tokenizer classes before loading folders that use
    them (saving an instance registers its class too).
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_class takes a class, got {type(cls).__name__} {cls!r}.")
    _USER_CLASSES[(cls.__module__, cls.__name__)] = cls
    return cls


def find_library_class(class_name: str | None) -> type | None:
    """The library class registered as `class_name` (None when there is none)."""
    while _IMPORTERS:  # registers every library class; later lookups find them in the table
        _IMPORTERS[0]()
        _IMPORTERS.pop(0)  # after it ran: an import that failed is tried again by the next lookup
    return _CLASSES.get(class_name or "")


def find_registered_class(module: str, class_name: str) -> type | None:
    """The user class registered under `module`.`class_name` (None when there is none)."""
    return _USER_CLASSES.get((module, class_name))


def is_library_class(cls: type) -> bool:
    return _CLASSES.get(cls.__name__) is cls
