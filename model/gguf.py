"""GGUF files: the bounds-checked mmap reader (model.gguf_reader) and the writers (model.gguf_writer)."""

from __future__ import annotations

from model.gguf_reader import (
    DEFAULT_ALIGNMENT,
    SUPPORTED_ARCHITECTURES,
    GGUFError,
    GGUFFile,
    TensorInfo,
    describe,
    model_config,
)
from model.gguf_writer import llama_metadata, write_gguf, write_lora_gguf

__all__ = [
    "llama_metadata",
    "DEFAULT_ALIGNMENT",
    "SUPPORTED_ARCHITECTURES",
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "describe",
    "model_config",
    "write_gguf",
    "write_lora_gguf",
]
