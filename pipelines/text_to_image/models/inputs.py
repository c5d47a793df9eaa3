"""Checks of forward inputs, shared by the reference models: each failure is a CallError that says
which model and argument, what the config expects and what was given."""

from __future__ import annotations

import torch

from ...errors import CallError


def check_rank(model: str, name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.ndim != rank:
        raise CallError(
            f"{model}: `{name}` must be a {rank}-d tensor {layout}, got shape {tuple(tensor.shape)}."
        )


def check_last_dim(model: str, name: str, tensor: torch.Tensor, expected: int, config_field: str) -> None:
    if tensor.shape[-1] != expected:
        raise CallError(
            f"{model}: `{name}` has last dimension {tensor.shape[-1]} but config.{config_field} is {expected} "
            f"(shape {tuple(tensor.shape)}); pass embeddings from an encoder of that width."
        )


def check_channels(model: str, name: str, tensor: torch.Tensor, expected: int, config_field: str) -> None:
    if tensor.shape[1] != expected:
        raise CallError(
            f"{model}: `{name}` has {tensor.shape[1]} channels but config.{config_field} is {expected} "
            f"(shape {tuple(tensor.shape)})."
        )


def check_spatial_multiple(model: str, name: str, tensor: torch.Tensor, multiple: int) -> None:
    height, width = tensor.shape[-2:]
    if height % multiple or width % multiple:
        raise CallError(
            f"{model}: `{name}` is {height}x{width}; both sides must be multiples of {multiple}. "
            f"Choose an image size whose latents divide evenly."
        )


def check_pooled(model: str, pooled: torch.Tensor | None, expected_dim: int | None, batch: int) -> None:
    """`pooled` is required exactly when the config has a `pooled_projection_dim`."""
    if expected_dim is None:
        if pooled is not None:
            raise CallError(
                f"{model}: got `pooled` but config.pooled_projection_dim is None (this model takes no pooled "
                f"text embedding); drop the argument or use a config with pooled_projection_dim set."
            )
        return
    if pooled is None:
        raise CallError(
            f"{model}: config.pooled_projection_dim is {expected_dim}, so `pooled` (B, {expected_dim}) is required."
        )
    check_rank(model, "pooled", pooled, 2, f"(B, {expected_dim})")
    check_last_dim(model, "pooled", pooled, expected_dim, "pooled_projection_dim")
    check_batch(model, "pooled", pooled, batch)


def check_denoiser_inputs(
    model: str, config, latents, encoder_hidden_states, pooled, *, spatial_multiple: int, text_dim_field: str
) -> None:
    """The denoiser call `(latents, timestep, encoder_hidden_states, pooled)` shared by UNet and DiT."""
    check_rank(model, "latents", latents, 4, "(B, C, H, W)")
    check_channels(model, "latents", latents, config.in_channels, "in_channels")
    check_spatial_multiple(model, "latents", latents, spatial_multiple)
    check_rank(model, "encoder_hidden_states", encoder_hidden_states, 3, "(B, S, D)")
    text_dim = getattr(config, text_dim_field)
    check_last_dim(model, "encoder_hidden_states", encoder_hidden_states, text_dim, text_dim_field)
    check_batch(model, "encoder_hidden_states", encoder_hidden_states, latents.shape[0])
    check_pooled(model, pooled, config.pooled_projection_dim, latents.shape[0])


def check_batch(model: str, name: str, tensor: torch.Tensor, batch: int) -> None:
    if tensor.shape[0] != batch:
        raise CallError(
            f"{model}: `{name}` has batch size {tensor.shape[0]} but the latents have {batch}."
        )


def timesteps_for_batch(
    model: str, timestep: torch.Tensor | float | int, batch: int, device: torch.device
) -> torch.Tensor:
    """A number, a 0-d or a (B,) tensor as a float32 (B,) tensor on `device`: one timestep per sample."""
    t = torch.as_tensor(timestep, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.ndim != 1 or t.shape[0] not in (1, batch):
        raise CallError(
            f"{model}: `timestep` must be a number or a tensor of shape () or ({batch},), got {tuple(t.shape)}."
        )
    return t.to(dtype=torch.float32).expand(batch)
