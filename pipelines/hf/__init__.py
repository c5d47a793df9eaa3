"""The diffusers/transformers bridge: what a placed pipeline must do for diffusers and transformers objects."""
