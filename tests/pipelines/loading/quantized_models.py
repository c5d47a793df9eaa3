"""Tiny models saved by diffusers and transformers for the quantized-format tests, their inputs, GGUF files written
with the `gguf` package, and the real storage of a loaded module measured from its tensors' storages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

FLUX = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
T5 = dict(vocab_size=64, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, relative_attention_num_buckets=8)


def save_flux(root: Path, seed: int = 0, *, layers: int = 1) -> Path:
    """A tiny FLUX transformer; with more `layers` its blocks are small enough next to the rest to be offloaded."""
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**{**FLUX, "num_layers": layers, "num_single_layers": layers}).eval()
    model.save_pretrained(root / "flux")
    return root / "flux"


def save_t5(root: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    transformers.T5EncoderModel(transformers.T5Config(**T5)).eval().save_pretrained(root / "t5")
    return root / "t5"


def flux_inputs(dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=generator).to(dtype),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=generator).to(dtype),
                pooled_projections=torch.randn(1, 32, generator=generator).to(dtype), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))


def run(model: nn.Module) -> torch.Tensor:
    """The model's output for its fixed input (a FLUX transformer's sample, a T5 encoder's hidden states)."""
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            return model(input_ids=torch.tensor([[5, 17, 42, 9, 3]])).last_hidden_state.cpu()
        dtype = next(t.dtype for t in model.parameters() if t.is_floating_point() and t.dtype.itemsize > 1)
        return model(**flux_inputs(dtype)).sample.cpu()


def real_storage(module: nn.Module) -> int:
    """Bytes of every distinct storage the module's tensors hold: wrapper subclasses (torchao, quanto) by their
    inner tensors, bitsandbytes weights with their quantization state; shared storages counted once."""
    seen: dict[int, int] = {}

    def visit(tensor: torch.Tensor) -> None:
        if type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(type(tensor), "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                if isinstance(getattr(tensor, name), torch.Tensor):
                    visit(getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        state = getattr(tensor, "quant_state", None)
        while state is not None:  # bitsandbytes' QuantState, and its nested state when double-quantized
            for name in ("absmax", "code", "offset"):
                if isinstance(getattr(state, name, None), torch.Tensor):
                    visit(getattr(state, name))
            state = getattr(state, "state2", None)
        scales = getattr(tensor, "SCB", None)
        if isinstance(scales, torch.Tensor):
            visit(scales)

    for tensor in [*module.parameters(), *module.buffers()]:
        visit(tensor)
    return sum(seen.values())


def write_gguf(state_dict: dict[str, torch.Tensor], path: Path, quant_type: str) -> Path:
    """A GGUF file of `state_dict` (diffusers key names): 2-D weights whose rows fit the format's blocks stored in
    `quant_type` ("Q8_0" quantized by `gguf` itself; "Q4_K", which `gguf` cannot quantize, as valid random blocks
    with small scales), every other tensor as float32."""
    import gguf

    kind = gguf.GGMLQuantizationType[quant_type]
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    writer = gguf.GGUFWriter(str(path), "tiny")
    rng = np.random.default_rng(0)
    for name, tensor in state_dict.items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % block == 0:
            data = gguf.quants.quantize(array, kind) if quant_type == "Q8_0" else _random_k_blocks(
                array.shape, block, type_size, rng)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_k_blocks(shape, block: int, type_size: int, rng) -> np.ndarray:
    """K-quant blocks whose two leading fp16 scales (d, dmin) are small and whose sub-scales and quants are random."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scales = np.frombuffer(np.array([0.01, 0.005], dtype=np.float16).tobytes(), dtype=np.uint8)
    blocks[..., :4] = scales
    return blocks.reshape(rows, cols // block * type_size)
