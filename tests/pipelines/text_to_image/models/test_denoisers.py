"""UNet and DiT honour the denoiser interface: denoiser(latents, timestep, encoder_hidden_states, pooled=None)."""

from __future__ import annotations

import pytest
import torch

from pipelines.errors import CallError
from pipelines.text_to_image.models import DiT, UNet

from reference_inputs import denoiser_inputs, tiny
from same_output import assert_same_output


@pytest.fixture(scope="module", params=[UNet, DiT], ids=lambda cls: cls.__name__)
def denoiser(request):
    return tiny(request.param)


def test_output_has_the_latents_shape_and_depends_on_every_input(denoiser):
    latents, timestep, context, pooled = denoiser_inputs(denoiser)
    with torch.no_grad():
        output = denoiser(latents, timestep, context, pooled)
        assert output.shape == latents.shape and torch.isfinite(output).all()
        for changed in (
            denoiser(latents, timestep + 100, context, pooled),
            denoiser(latents, timestep, context + 1, pooled),
            denoiser(latents, timestep, context, pooled + 1),
        ):
            assert not torch.allclose(changed, output)


def test_timestep_forms_agree(denoiser):
    latents, _, context, pooled = denoiser_inputs(denoiser)
    with torch.no_grad():
        reference = denoiser(latents, torch.tensor([400.0, 400.0]), context, pooled)
        for timestep in (400, 400.0, torch.tensor(400.0), torch.tensor([400.0])):
            assert_same_output(denoiser(latents, timestep, context, pooled), reference)


def test_each_sample_is_independent_of_the_rest_of_the_batch(denoiser):
    latents, timestep, context, pooled = denoiser_inputs(denoiser)
    with torch.no_grad():
        batched = denoiser(latents, timestep, context, pooled)
        single = denoiser(latents[1:], timestep[1:], context[1:], pooled[1:])
    assert_same_output(batched[1:], single)


def test_non_square_latents(denoiser):
    latents, timestep, context, pooled = denoiser_inputs(denoiser)
    wide = torch.randn(2, latents.shape[1], 4, 12)
    with torch.no_grad():
        assert denoiser(wide, timestep, context, pooled).shape == wide.shape


def test_dit_patchify_and_unpatchify_are_inverse():
    model = tiny(DiT)
    latents = torch.randn(2, model.config.in_channels, 6, 10)
    tokens = model.patchify(latents)
    assert tokens.shape == (2, 3 * 5, model.config.in_channels * 4)
    assert torch.equal(model.unpatchify(tokens, 6, 10), latents)


def test_dit_image_tokens_see_each_other_and_positions_matter():
    """Changing one latent patch changes the output elsewhere (attention), and swapping two patches does not
    merely swap the outputs (position embedding)."""
    model = tiny(DiT)
    latents, timestep, context, pooled = denoiser_inputs(model, batch=1)
    with torch.no_grad():
        base = model(latents, timestep, context, pooled)
        poked = latents.clone()
        poked[..., :2, :2] += 1
        changed = model(poked, timestep, context, pooled)
        assert not torch.allclose(changed[..., 4:, 4:], base[..., 4:, 4:])
        swapped = latents.clone()
        swapped[..., :2, :2], swapped[..., 2:4, :2] = latents[..., 2:4, :2], latents[..., :2, :2]
        out = model(swapped, timestep, context, pooled)
        assert not torch.allclose(out[..., :2, :2], base[..., 2:4, :2])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda l, c, p: (l[:, :1], c, p), "in_channels"),
        (lambda l, c, p: (l[..., :7, :], c, p), "multiples of"),
        (lambda l, c, p: (l, c[..., :-1], p), "last dimension"),
        (lambda l, c, p: (l, c[:1], p), "batch size"),
        (lambda l, c, p: (l, c, None), "pooled"),
        (lambda l, c, p: (l, c, p[..., :-1]), "pooled_projection_dim"),
        (lambda l, c, p: (l[0], c, p), "4-d"),
    ],
)
def test_bad_inputs_raise_a_typed_error_naming_the_problem(denoiser, mutate, message):
    latents, timestep, context, pooled = denoiser_inputs(denoiser)
    latents, context, pooled = mutate(latents, context, pooled)
    with pytest.raises(CallError, match=message):
        denoiser(latents, timestep, context, pooled)


def test_pooled_is_refused_by_a_model_without_pooled_conditioning():
    with_pooled = tiny(UNet)
    model = UNet.from_config(with_pooled.config, pooled_projection_dim=None).eval()
    latents, timestep, context, pooled = denoiser_inputs(with_pooled)
    with torch.no_grad():
        assert model(latents, timestep, context).shape == latents.shape
    with pytest.raises(CallError, match="pooled_projection_dim is None"):
        model(latents, timestep, context, pooled)


def test_bad_timestep_shape(denoiser):
    latents, _, context, pooled = denoiser_inputs(denoiser)
    with pytest.raises(CallError, match="timestep"):
        denoiser(latents, torch.ones(3), context, pooled)
