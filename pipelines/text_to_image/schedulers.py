"""FlowMatchEulerScheduler: Euler steps along rectified flow's straight noise-to-data path (SD3, Flux).

x_sigma = (1 - sigma) * x_0 + sigma * noise; the denoiser predicts the velocity noise - x_0 at timestep
sigma * num_train_timesteps. `shift` > 1 spends more steps at high noise, as diffusers'
FlowMatchEulerDiscreteScheduler does for high resolutions."""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

from ..errors import CallError
from ..folder.class_registry import library_class
from .config_file import ConfigFileComponent

SCHEDULER_CONFIG_NAME = "scheduler_config.json"


class FlowMatchEulerSchedulerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_train_timesteps: PositiveInt = 1000
    shift: PositiveFloat = 1.0


@library_class
class FlowMatchEulerScheduler(ConfigFileComponent):
    """`set_timesteps(n)`, then for each `t` in `timesteps`: `sample = step(model_output, t, sample)`."""

    config_class = FlowMatchEulerSchedulerConfig
    config_name = SCHEDULER_CONFIG_NAME
    _sigmas: torch.Tensor | None = None

    @property
    def sigmas(self) -> torch.Tensor:
        """Noise levels, one per timestep plus the final 0 (float32, CPU)."""
        return self._require_schedule()

    @property
    def timesteps(self) -> torch.Tensor:
        """What the denoiser is called with at each step: sigma * num_train_timesteps (float32, CPU)."""
        return self._require_schedule()[:-1] * self._config.num_train_timesteps

    @property
    def init_noise_sigma(self) -> float:
        """Initial latents are unit Gaussian noise (sigma 1), unscaled."""
        return 1.0

    def set_timesteps(self, num_inference_steps: int) -> None:
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise CallError(f"num_inference_steps must be a positive integer, got {num_inference_steps!r}.")
        total = self._config.num_train_timesteps
        sigmas = torch.linspace(1.0, 1.0 / total, num_inference_steps, dtype=torch.float64)
        shift = self._config.shift
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self._sigmas = torch.cat([sigmas, sigmas.new_zeros(1)]).to(torch.float32)

    def step(self, model_output: torch.Tensor, timestep: torch.Tensor | float, sample: torch.Tensor) -> torch.Tensor:
        """The sample at the next noise level; computed in float32, returned in the sample's dtype."""
        if model_output.shape != sample.shape:
            raise CallError(f"model_output has shape {tuple(model_output.shape)} but sample has {tuple(sample.shape)}.")
        index = self.index_for_timestep(timestep)
        sigmas = self._require_schedule()
        delta = float(sigmas[index + 1] - sigmas[index])
        prev = sample.float() + delta * model_output.to(sample.device, torch.float32)
        return prev.to(sample.dtype)

    def scale_noise(self, sample: torch.Tensor, timestep: torch.Tensor | float, noise: torch.Tensor) -> torch.Tensor:
        """Forward process: the clean `sample` noised to `timestep`'s level (for image-to-image and training)."""
        sigma = float(self._require_schedule()[self.index_for_timestep(timestep)])
        return ((1.0 - sigma) * sample.float() + sigma * noise.float()).to(sample.dtype)

    def index_for_timestep(self, timestep: torch.Tensor | float) -> int:
        """Position of `timestep` in `timesteps` (matched to a relative 1e-5, so float16 round trips work)."""
        value = float(torch.as_tensor(timestep).reshape(-1)[0]) if torch.is_tensor(timestep) else float(timestep)
        timesteps = self.timesteps
        for index, candidate in enumerate(timesteps.tolist()):
            if math.isclose(candidate, value, rel_tol=1e-5, abs_tol=1e-3):
                return index
        raise CallError(
            f"timestep {value} is not in this schedule ({len(timesteps)} steps from {timesteps[0]:.2f} to "
            f"{timesteps[-1]:.2f}); call step() with the values of scheduler.timesteps."
        )

    def _require_schedule(self) -> torch.Tensor:
        if self._sigmas is None:
            raise CallError("No schedule yet: call scheduler.set_timesteps(num_inference_steps) first.")
        return self._sigmas

