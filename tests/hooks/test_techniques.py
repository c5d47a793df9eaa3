"""The technique table: one row per technique, one calling shape, one conflict check, every pair covered."""

import copy
import dataclasses
import importlib
import inspect
import itertools
import pickle
import pkgutil
import types

import accelerate.hooks
import pytest
import torch
from torch import nn

import hooks
from hooks import (
    TECHNIQUES,
    DeviceMapConfig,
    GroupOffloadingConfig,
    LayerwiseCastingConfig,
    ModelOffloadConfig,
    OffloadConflictError,
    ResidencyConfig,
    SequentialOffloadConfig,
    Technique,
    techniques_on,
)
from hooks.layerwise_casting import DEFAULT_SKIP_MODULES_CLASSES
from placement.errors import PlacementError


@pytest.fixture(autouse=True)
def one_virtual_gpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")  # per-call residency executes on an accelerator


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), nn.Linear(8, 4))


CONFIGS = {
    Technique.DEVICE_MAP: DeviceMapConfig(device_map={"0": "cpu", "1": "cpu", "2": "cpu"}, execution_device="cpu"),
    Technique.MODEL_OFFLOAD: ModelOffloadConfig(execution_device="cpu"),
    Technique.SEQUENTIAL_OFFLOAD: SequentialOffloadConfig(execution_device="cpu"),
    Technique.GROUP_OFFLOAD: GroupOffloadingConfig(onload_device="cpu"),
    Technique.LAYERWISE_CASTING: LayerwiseCastingConfig(storage_dtype=torch.bfloat16, compute_dtype=torch.float32,
                                                        skip_modules_pattern=(),
                                                        skip_modules_classes=DEFAULT_SKIP_MODULES_CLASSES),
    Technique.PER_CALL_RESIDENCY: ResidencyConfig(execution_device=0, device_map={"": "cpu"},
                                                  per_call_modules=("0", "2"), streamed_modules=("1",)),
}


def apply(technique: Technique, model: nn.Module):
    return TECHNIQUES[technique].apply(model, CONFIGS[technique])


def test_every_technique_has_a_row_whose_config_class_it_takes():
    assert set(TECHNIQUES) == set(Technique)
    for technique, spec in TECHNIQUES.items():
        assert spec.technique is technique and isinstance(CONFIGS[technique], spec.config_class)
        assert technique not in spec.refuses or technique is Technique.PER_CALL_RESIDENCY
    # Per-call residency was added as one row: no other row names it, its own says both sides.
    others = [spec for technique, spec in TECHNIQUES.items() if technique is not Technique.PER_CALL_RESIDENCY]
    assert all(Technique.PER_CALL_RESIDENCY not in {*spec.refuses, *spec.refused_after} for spec in others)
    assert hooks.OFFLOADING == {Technique.MODEL_OFFLOAD, Technique.SEQUENTIAL_OFFLOAD, Technique.GROUP_OFFLOAD,
                                Technique.PER_CALL_RESIDENCY}


@pytest.mark.parametrize("technique", list(Technique))
def test_one_calling_shape_returns_a_handle_that_removes_it(technique):
    model = make()
    with torch.no_grad():
        expected = model[0](torch.ones(1, 8))
    handle = apply(technique, model)
    assert technique in techniques_on(model) and handle.technique is technique
    with torch.no_grad():
        torch.testing.assert_close(model[0](torch.ones(1, 8)).float(), expected, atol=2e-2, rtol=0)
    handle.remove()
    assert techniques_on(model) == {}


@pytest.mark.parametrize("technique", list(Technique))
def test_the_row_removes_it_and_so_does_remove_technique(technique):
    model = make()
    apply(technique, model)
    TECHNIQUES[technique].remove(model)
    assert techniques_on(model) == {}
    apply(technique, model)
    hooks.remove_technique(model, technique.value)
    assert techniques_on(model) == {}


@pytest.mark.parametrize("present, applying", [pair for pair in itertools.permutations(Technique, 2)
                                               if pair[1] is not Technique.DEVICE_MAP])
def test_the_table_decides_every_pair(present, applying):
    model = make()
    apply(present, model)
    if present in TECHNIQUES[applying].refuses or applying in TECHNIQUES[present].refused_after:
        with pytest.raises(OffloadConflictError, match=f"already has {present.value}.*Remove it first"):
            apply(applying, model)
    else:  # the pair combines: both are on the tree and the model still runs
        apply(applying, model)
        assert {present, applying} <= set(techniques_on(model))
        with torch.no_grad():
            assert model[0](torch.ones(1, 8)).shape == (1, 8)


def test_rows_are_registered_in_technique_order():
    assert list(TECHNIQUES) == list(Technique)


def test_each_config_class_declares_its_technique_and_the_face_exports_each_row():
    assert Technique.undeclared() == []  # every technique a row names is declared by some file
    for technique, spec in TECHNIQUES.items():
        assert spec.config_class.technique is technique and Technique(technique.value) is technique
        assert copy.deepcopy(technique) is technique and pickle.loads(pickle.dumps(technique)) is technique
        for part in (spec.config_class, spec.apply, spec.remove):
            assert getattr(hooks, part.__name__) is part and part.__name__ in hooks.__all__
    # Users and messages read the values; they stay as they were.
    assert {t.value for t in Technique} == {"a device map", "model offload", "sequential offload",
                                            "group offloading", "layerwise casting", "per-call residency"}
    with pytest.raises(hooks.OffloadConfigError, match="No technique 'group offload'.*group offloading"):
        hooks.remove_technique(make(), "group offload")


@pytest.fixture
def scratch_table(monkeypatch):
    """The technique table and declarations as they are, restored after the test."""
    monkeypatch.setattr(Technique, "_named", dict(Technique._named))
    monkeypatch.setattr(Technique, "_declared", list(Technique._declared))
    monkeypatch.setattr(hooks.techniques, "_ROWS", dict(hooks.techniques._ROWS))
    monkeypatch.setattr(hooks.techniques, "TECHNIQUES", types.MappingProxyType(hooks.techniques._ROWS))
    monkeypatch.setattr(hooks.techniques, "OFFLOADING", set(hooks.OFFLOADING))


def test_a_new_technique_is_its_own_file(scratch_table):
    """What a new technique's file does, alone: its config class declares it, its row registers it (refusing a
    technique by name, declared or not yet), and the table, the conflict check and the face know it."""
    from hooks.techniques import TechniqueConfig, TechniqueSpec, register, technique_face

    @dataclasses.dataclass(frozen=True)
    class EchoConfig(TechniqueConfig, technique="echo", name="ECHO"):
        note: str = ""

    class EchoHook(accelerate.hooks.ModelHook):
        technique = Technique.ECHO

    def apply_echo(module, config):
        hooks.check_compatible(module, row)
        accelerate.hooks.add_hook_to_module(module, EchoHook(), append=True)
        return hooks.Handle(technique=Technique.ECHO, module=module, config=config, remover=remove_echo)

    def remove_echo(module):
        accelerate.hooks.remove_hook_from_module(module)

    row = register(TechniqueSpec(technique=Technique.ECHO, config_class=EchoConfig, apply=apply_echo,
                                 remove=remove_echo, refuses={Technique.MODEL_OFFLOAD: "echoes need their weights"}))
    assert Technique.ECHO in list(Technique) and str(Technique.ECHO) == "echo" and EchoConfig.technique is Technique.ECHO
    assert hooks.techniques.TECHNIQUES[Technique.ECHO] is row
    assert {"EchoConfig", "apply_echo", "remove_echo"} <= set(technique_face())
    model = make()
    apply(Technique.MODEL_OFFLOAD, model)
    with pytest.raises(OffloadConflictError, match="Cannot apply echo .* already has model offload.*echoes need"):
        apply_echo(model, EchoConfig())
    with pytest.raises(PlacementError, match="declared twice"):
        Technique.declare("ECHO", "echo")
    with pytest.raises(PlacementError, match="declares Technique.ECHO"):
        register(dataclasses.replace(row, technique=Technique.GROUP_OFFLOAD))
    TECHNIQUES[Technique.MODEL_OFFLOAD].remove(model)


@pytest.mark.parametrize("technique", [t for t in Technique if TECHNIQUES[t].editor is not None])
def test_edits_and_gathers_go_through_the_row_of_the_technique_on_the_module(technique, monkeypatch):
    """`edit_placed_weights`, `weight_homes` and `offloaded_weights` know the techniques only by their rows."""
    model = make()
    apply(technique, model)
    row, seen = TECHNIQUES[technique], []

    class Spy:
        def __init__(self, editor):
            self.editor = editor

        def open(self):
            seen.append("open")
            self.editor.open()

        def close(self):
            seen.append("close")
            return self.editor.close()

        def homes(self):
            seen.append("homes")
            return self.editor.homes()

    def gather(module):
        seen.append("gather")
        return row.gather(module)

    spied = dataclasses.replace(row, editor=lambda module: (lambda e: e and Spy(e))(row.editor(module)),
                                gather=gather)
    monkeypatch.setitem(hooks.techniques._ROWS, technique, spied)
    with hooks.edit_placed_weights(model):
        pass
    hooks.weight_homes(model)
    hooks.gather.offloaded_weights(model)
    assert seen == ["open", "close", "homes", "gather"]
    TECHNIQUES[technique].remove(model)


def test_the_face_exports_its_entry_points_and_every_error_under_one_runtime_base():
    assert all(hasattr(hooks, name) for name in hooks.__all__)
    errors = {cls for info in pkgutil.walk_packages(hooks.__path__, "hooks.")
              for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass)
              if issubclass(cls, PlacementError) and cls.__module__.startswith("hooks")}
    assert errors and all(issubclass(cls, hooks.PlacementRuntimeError) for cls in errors)
    assert {cls.__name__ for cls in errors} <= set(hooks.__all__)
    assert issubclass(hooks.OffloadConfigError, ValueError) and issubclass(hooks.OffloadConflictError, RuntimeError)
