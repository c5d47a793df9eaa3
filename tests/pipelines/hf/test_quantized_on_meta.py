"""torchao on meta, once per distinct layer: `materialize_on_meta` quantizes one layer of each (class, weight
shape and dtype, bias) and copies it to the others; the result is what quantizing every layer gives."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from pipelines.hf.quantizers import ComponentQuantization, QuantizationMethod, materialize_on_meta
from placement.sizing import size_module

diffusers = pytest.importorskip("diffusers")
torchao = pytest.importorskip("torchao.quantization")


def meta_flux():
    with init_empty_weights():
        model = diffusers.FluxTransformer2DModel(num_layers=2, num_single_layers=3, attention_head_dim=16,
                                                 num_attention_heads=2, joint_attention_dim=32,
                                                 pooled_projection_dim=16)
    return model.to(torch.bfloat16)


def test_each_layer_quantized_as_quantizing_every_layer_does():
    names = [f"{path}.weight" for path, layer in meta_flux().named_modules() if isinstance(layer, torch.nn.Linear)]
    quantization = ComponentQuantization(config=diffusers.TorchAoConfig(torchao.Int8WeightOnlyConfig()),
                                         pre_quantized=False, method=QuantizationMethod.TORCHAO)
    ours = meta_flux()
    materialize_on_meta(ours, quantization, names)
    every = meta_flux()
    torchao.quantize_(every, torchao.Int8WeightOnlyConfig())

    kinds = {name: type(t).__name__ for name, t in ours.named_parameters()}
    assert kinds == {name: type(t).__name__ for name, t in every.named_parameters()}
    assert "Int8Tensor" in kinds.values()
    assert size_module(ours).total == size_module(every).total
    # Copies, not one shared tensor: a layer's weight can be replaced without touching its twins.
    weights = [layer.weight for layer in ours.modules() if isinstance(layer, torch.nn.Linear)]
    assert len({id(weight) for weight in weights}) == len(weights)
