"""The only reader of the stage cache's result records: JSON manifests of a known schema, nothing else.

A Prefect result record names the serializer of its payload, and Prefect deserializes with whatever it names:
a Python-object serializer runs code, and even its JSON serializer imports the modules a record names
(`__class__`, `object_decoder`). A workdir may be shared (the Ray set-up asks for it), so a record is untrusted input:
`manifest_record` parses it with the json module alone, accepts a record only when its serializer is plain
JSON and its payload is one of the manifest classes below validated by pydantic, and raises BadRecord
otherwise (the caller's cache miss). Nothing here imports Prefect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import schemas.manifests
import schemas.preferences
from schemas.manifests import Manifest

# Records are stored as '<stage>-typed-<sha256>': the manifests a task returns now, never the plain dicts that
# earlier versions stored under '<stage>-<sha256>'. The sha256 (and so every stage folder) is the content key.
RECORD_FORMAT = "typed"
MAX_RECORD_BYTES = 1 << 24  # a manifest is a few kB; a record larger than 16 MiB is not ours


class BadRecord(ValueError):
    """A result record that is not a JSON manifest of a known schema (a cache miss, never deserialized)."""


def record_key(stage: str, key: str) -> str:
    """The result record of stage `stage`'s content key `key` ('<stage>-<sha256>')."""
    return f"{stage}-{RECORD_FORMAT}-{key.rsplit('-', 1)[-1]}"


def _manifest_classes() -> dict[str, type[Manifest]]:
    """'module.Class' -> class of every manifest a stage returns."""
    found: dict[str, type[Manifest]] = {}
    for module in (schemas.manifests, schemas.preferences):
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, Manifest) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


MANIFESTS = _manifest_classes()


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord(f"{what} is {type(value).__name__}, not a JSON object")
    return value


def manifest_record(content: bytes) -> Manifest:
    """The manifest a Prefect JSON result record holds; BadRecord naming what is wrong otherwise."""
    if len(content) > MAX_RECORD_BYTES:
        raise BadRecord(f"{len(content)} bytes, larger than any manifest record")
    try:
        outer = _mapping(json.loads(content), "the record")
        serializer = _mapping(_mapping(outer.get("metadata"), "metadata").get("serializer"), "metadata.serializer")
        if serializer.get("type") != "json":
            raise BadRecord(f"names the {serializer.get('type')!r} serializer; only JSON manifests are read")
        if not isinstance(outer.get("result"), str):
            raise BadRecord("result is not JSON text")
        inner = _mapping(json.loads(outer["result"]), "result")
        cls = MANIFESTS.get(str(inner.get("__class__")))
        if cls is None:
            raise BadRecord(f"holds {str(inner.get('__class__', 'a plain object'))[:80]}, not a stage manifest")
        return cls.model_validate(inner.get("data"))
    except BadRecord:
        raise
    except (ValueError, TypeError, RecursionError) as exc:  # json and pydantic errors are ValueErrors
        raise BadRecord(f"not a valid manifest record ({type(exc).__name__})") from None


def read_manifest_record(path: Path) -> Manifest:
    """manifest_record of the file `path`, read up to the size cap; BadRecord naming the file otherwise (an
    unreadable file included)."""
    try:
        with open(path, "rb") as f:
            return manifest_record(f.read(MAX_RECORD_BYTES + 1))
    except OSError as exc:
        raise BadRecord(f"{path}: unreadable ({exc.strerror or type(exc).__name__})") from None
    except BadRecord as exc:
        raise BadRecord(f"{path}: {exc}") from None
