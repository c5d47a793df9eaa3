"""The classes a saved folder may name, and the only places a class named by a folder is looked up.

A folder records the class of each component. For this library's own classes it records the library
("pipelines") and the class name, never a module path, so classes can move between modules without breaking
folders saved earlier: each registers itself with `@library_class` where it is defined. The modules that define
them sit above this one, so this registry never imports them by name: the package face (`pipelines/__init__.py`,
which runs before any `pipelines.x.y` can be imported) declares each library class's name with the function that
imports its module (`declare_library_classes`), and the first lookup of that name calls it. A name that is not
declared (a diffusers pipeline class, say) imports nothing.

A user's own class is recorded under its module path (`["my_models.vae", "MyVAE"]`). Resolving such a name never
imports anything: the class must be registered with `pipelines.register_class(MyVAE)` (saving an instance
registers its class in the saving process), or passed to `from_pretrained`, because importing a module named by
a folder runs that module's code. `trust_remote_code=True` is the explicit opt-in that imports it anyway (see
`model_index.resolve_class`).
"""

from __future__ import annotations

from typing import Callable, Mapping

LIBRARY = "pipelines"
_CLASSES: dict[str, type] = {}
_USER_CLASSES: dict[tuple[str, str], type] = {}
_DECLARED: dict[str, Callable[[], object]] = {}  # library class name -> imports its module (the package face's)


def declare_library_classes(importers: Mapping[str, Callable[[], object]]) -> None:
    """Declare library classes by name, each with the function that imports the module defining it (whose
    `@library_class` then registers it): looked up lazily, so finding one class imports one module."""
    _DECLARED.update(importers)


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
    name = class_name or ""
    if name not in _CLASSES and name in _DECLARED:
        _DECLARED[name]()  # importing its module registers it
    return _CLASSES.get(name)


def find_registered_class(module: str, class_name: str) -> type | None:
    """The user class registered under `module`.`class_name` (None when there is none)."""
    return _USER_CLASSES.get((module, class_name))


def is_library_class(cls: type) -> bool:
    return _CLASSES.get(cls.__name__) is cls
