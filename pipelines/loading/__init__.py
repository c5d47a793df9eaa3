"""The one loader of models and pipelines: a request resolved once, one meta builder, one plan, one placer."""
