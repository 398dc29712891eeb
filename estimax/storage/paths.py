"""Paths and URLs: a local path, ``file://``, ``gs://``, ``s3://`` or ``memory://``, one way.

Owns turning what a user typed into a usable location (``~`` and ``$VARS``
expanded, a local path made absolute, a URL kept a URL: never ``os.path`` on a
URL, never a local folder named after one) and taking locations apart (scheme,
name, parent) or together (join). Pure string work: it touches no store.
Does not own reading or writing (``files.py``).
"""

from __future__ import annotations

import os
import posixpath


def expand(path: str | os.PathLike) -> str:
    """``path`` with ``$VARS`` and (for a local path) ``~`` expanded; ``file://x`` becomes ``x``."""
    text = os.path.expandvars(os.fspath(path))
    if text.startswith("file://"):
        text = text[len("file://") :]
    return text if is_url(text) else os.path.expanduser(text)


def resolve(path: str | os.PathLike) -> str:
    """``expand(path)``, made absolute when local; a URL without its trailing ``/``."""
    text = expand(path)
    return text.rstrip("/") if is_url(text) else os.path.abspath(text)


def scheme(path: str) -> str:
    """``"gs"``, ``"s3"``, ``"memory"``, ...; ``""`` for a local path."""
    head, sep, _ = os.fspath(path).partition("://")
    return head if sep and head.isidentifier() else ""


def is_url(path: str) -> bool:
    return scheme(path) not in ("", "file")


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def name(path: str) -> str:
    """The last component: ``run`` of ``gs://bucket/run`` or ``/tmp/run/``."""
    return (posixpath if is_url(path) else os.path).basename(path.rstrip("/"))


def parent(path: str) -> str:
    return (posixpath if is_url(path) else os.path).dirname(path.rstrip("/"))
