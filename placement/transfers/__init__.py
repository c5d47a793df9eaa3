"""The transfer model (docs/design.md, "When it does not fit"): what crosses host -> accelerator per call."""
