"""How a pipeline's name is read: a local path, or a Hugging Face Hub id. Imports nothing beyond the standard
library, so that the command line can say "No such folder" before torch loads."""

from __future__ import annotations


def looks_like_a_path(text: str) -> bool:
    """"./x", "x/", "/x", "~/x", "a/b/c", "C:\\x": a local path, never a Hub id ("name" or "owner/name")."""
    return text.startswith((".", "/", "~")) or text.endswith("/") or "\\" in text or text.count("/") > 1
