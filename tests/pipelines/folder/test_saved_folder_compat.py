"""Folders written by an earlier release keep loading after classes move between modules.

`tests/fixtures/saved_v0_1_tiny_unet` was written by `TextToImagePipeline.save_pretrained` at release 0.1 (fp16
weights, classes named as ["pipelines", "ClassName"]), and `..._tiny_unet.expected.safetensors` holds the images
that release generated from it. The class registry (not a module path) resolves those names, so moving a class
to another module must not break this test.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file

from pipelines import Pipeline, TextToImagePipeline

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
FOLDER = FIXTURES / "saved_v0_1_tiny_unet"


def _generate(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe("a lighthouse", height=16, width=16, num_inference_steps=2, generator=generator,
                output_type="pt").images


def test_a_folder_saved_by_release_0_1_loads_and_generates_the_same_images():
    expected = load_file(FIXTURES / "saved_v0_1_tiny_unet.expected.safetensors")["images"]
    pipe = TextToImagePipeline.from_pretrained(FOLDER)
    torch.testing.assert_close(_generate(pipe), expected)


def test_the_generic_loader_resolves_its_class_names_too():
    pipe = Pipeline.from_pretrained(FOLDER)
    assert type(pipe.denoiser).__name__ == "UNet" and type(pipe.tokenizer).__name__ == "ByteTokenizer"
