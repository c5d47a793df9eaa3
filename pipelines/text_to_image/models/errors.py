"""Typed errors of the reference models: a forward call given inputs the model cannot take."""

from placement.errors import PlacementError


class ModelInputError(PlacementError, ValueError):
    """A call argument (an input tensor, a tiling setting) that does not match what the model can take.

    The message names the model, the argument, what the config expects and what was given.
    """
