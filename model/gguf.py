"""GGUF files: the bounds-checked mmap reader (model.gguf_reader) and the writers (model.gguf_writer), and the one
check a run makes of a model file before any work (check_model_file)."""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.gguf_reader import (
    DEFAULT_ALIGNMENT,
    SUPPORTED_ARCHITECTURES,
    GGUFError,
    GGUFFile,
    TensorInfo,
    describe,
    family_name,
    gguf_error,
    model_config,
)
from model.gguf_writer import (
    llama3_rope_factors,
    llama_metadata,
    model_metadata,
    rewrite_gguf,
    write_gguf,
    write_lora_gguf,
)
from model.tokenizer import check_tokenizer_metadata

__all__ = [
    "llama_metadata",
    "DEFAULT_ALIGNMENT",
    "SUPPORTED_ARCHITECTURES",
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "check_model_file",
    "describe",
    "family_name",
    "llama3_rope_factors",
    "model_config",
    "model_metadata",
    "rewrite_gguf",
    "write_gguf",
    "write_lora_gguf",
]


def check_model_file(path: str | Path) -> ModelConfig:
    """The model's config, after refusing (GGUFError naming the file and the key or tensor) anything distillery
    cannot run: an unknown or unsupported architecture or setting, a tensor it would not use or of a quant type
    it cannot decode, a tokenizer it cannot build. Cheap (headers only): the preflight calls it."""
    with GGUFFile(path) as f:
        cfg = f.check_model()
        try:
            check_tokenizer_metadata(f.metadata)
        except ValueError as exc:
            key = str(exc).split("=", 1)[0].split(" ", 1)[0]
            raise gguf_error(path, f"key {key!r}", "value", str(exc)) from None
    return cfg
