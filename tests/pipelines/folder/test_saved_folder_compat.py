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


# The folder computes in fp16 (its weights' dtype) and the expected images were made on another CPU. fp16 keeps 10
# mantissa bits: one ULP at 1.0 (images lie in [0, 1]) is 2**-10 ~ 1e-3, and CPUs that accumulate fp16 in a
# different order (AVX-512 FP16 on AMD Zen 5 against AVX2 elsewhere) end 2.7e-3 apart; the fp16 run's own error
# (fp32 against fp16 here) is 1.9e-3. 1e-2 (~10 ULPs) covers two such errors of opposite sign and still fails
# on a real change: one more denoising step moves the images by 5e-2, another seed by 0.8.
FP16_IMAGE_ATOL = 1e-2


def test_a_folder_saved_by_release_0_1_loads_and_generates_the_same_images():
    expected = load_file(FIXTURES / "saved_v0_1_tiny_unet.expected.safetensors")["images"]
    pipe = TextToImagePipeline.from_pretrained(FOLDER)
    assert next(pipe.denoiser.parameters()).dtype == torch.float16  # the tolerance below is fp16's
    torch.testing.assert_close(_generate(pipe), expected, atol=FP16_IMAGE_ATOL, rtol=0)


def test_the_generic_loader_resolves_its_class_names_too():
    pipe = Pipeline.from_pretrained(FOLDER)
    assert type(pipe.denoiser).__name__ == "UNet" and type(pipe.tokenizer).__name__ == "ByteTokenizer"
