"""Presets built on meta: every tensor on meta, nothing initialised (there is nothing to write), the CPU build as
before."""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipelines.text_to_image.presets import NoInitOnMeta, build_preset_components


class Ops(TorchDispatchMode):
    """The aten ops that reach dispatch."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def initialise(tensor):
    nn.init.kaiming_uniform_(tensor)
    nn.init.normal_(tensor)
    tensor.uniform_()
    tensor.zero_()


def test_initialisation_is_skipped_on_meta_only():
    meta, real = torch.empty(3, 2, device="meta"), torch.zeros(3, 2)
    with Ops() as ops:
        initialise(meta)
    assert ops.names  # torch runs each on meta (through its Python reference kernels)
    with Ops() as ops, NoInitOnMeta():
        initialise(meta)
        nn.init.ones_(real)
        real.add_(1)
    assert ops.names and all(name.startswith(("fill", "add")) for name in ops.names)  # only the real tensor's
    assert real.tolist() == [[2.0, 2.0]] * 3


def test_the_flux_like_preset_is_all_meta():
    components = build_preset_components("flux-like", device="meta")
    modules = [value for value in components.values() if isinstance(value, nn.Module)]
    assert len(modules) == 4
    tensors = [t for module in modules for t in (*module.parameters(), *module.buffers())]
    assert tensors and all(t.is_meta for t in tensors)
    assert sum(t.numel() for t in modules[2].parameters()) > 11e9  # the 12B DiT, built in no memory


def test_the_cpu_build_is_initialised_and_seeded():
    first = build_preset_components("tiny-dit", seed=3)["denoiser"]
    second = build_preset_components("tiny-dit", seed=3)["denoiser"]
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert any(p.abs().sum() > 0 for p in first.parameters())
