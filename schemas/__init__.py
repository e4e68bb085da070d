"""Run config, Arrow schemas of every file we write, and stage manifests. Imports nothing of ours."""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve lazily (PEP 562): `from schemas.optim import ...` in gpu/ and cpu/ must not import pydantic and
# pyarrow, which the GPU device image lacks.
_WHERE = {
    "LORA_TARGET_NAMES": "config",
    "QUANT_NAMES": "config",
    "ConfigError": "config",
    "DataSection": "config",
    "EvalSection": "config",
    "ExportSection": "config",
    "LoraSection": "config",
    "LossSection": "config",
    "ModelSection": "config",
    "OptimSection": "config",
    "RunConfig": "config",
    "RunSection": "config",
    "TeacherSection": "config",
    "TrainSection": "config",
    "config_fingerprint": "config",
    "dump_config": "config",
    "load_config": "config",
    "TOKEN_SHARD_SCHEMA": "files",
    "TOPK_MANIFEST": "files",
    "SchemaError": "files",
    "check_token_shard": "files",
    "topk_id_type": "files",
    "topk_schema": "files",
    "validate_table": "files",
    "CheckpointManifest": "manifests",
    "EvalManifest": "manifests",
    "ExportManifest": "manifests",
    "FileRef": "manifests",
    "ManifestError": "manifests",
    "ShardRecord": "manifests",
    "StudentManifest": "manifests",
    "TeacherManifest": "manifests",
    "TokenizeManifest": "manifests",
    "TokenSplit": "manifests",
    "sha256_file": "manifests",
}

__all__ = [
    "CheckpointManifest",
    "ConfigError",
    "DataSection",
    "EvalManifest",
    "EvalSection",
    "ExportManifest",
    "ExportSection",
    "FileRef",
    "LORA_TARGET_NAMES",
    "LoraSection",
    "LossSection",
    "ManifestError",
    "ModelSection",
    "OptimSection",
    "QUANT_NAMES",
    "RunConfig",
    "RunSection",
    "SchemaError",
    "ShardRecord",
    "StudentManifest",
    "TOKEN_SHARD_SCHEMA",
    "TOPK_MANIFEST",
    "TeacherManifest",
    "TeacherSection",
    "TokenSplit",
    "TokenizeManifest",
    "TrainSection",
    "check_token_shard",
    "config_fingerprint",
    "dump_config",
    "load_config",
    "sha256_file",
    "topk_id_type",
    "topk_schema",
    "validate_table",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    return getattr(importlib.import_module(f"schemas.{module}"), name)
