"""Whole-model conversions, streamed tensor by tensor: dequantize to F32 (teacher) and requantize (student)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from model import quant
from model.gguf import GGUFFile, rewrite_gguf

# The (tied) embedding is also the lm_head, which LoRA cannot adapt: the student keeps it at 8 bits, as
# llama.cpp's K-quant mixes keep token_embd/output at >= 6 bits.
EMBEDDING_TENSORS = ("token_embd.weight", "output.weight")


def dequantize_gguf(src: Path, dst: Path) -> Path:
    """Write `src` with every tensor as F32 (the demo teacher)."""
    with GGUFFile(src) as f:

        def tensors() -> Iterator[tuple[str, np.ndarray, int]]:
            for info, _ in f.iter_tensors():
                yield info.name, f.tensor_f32(info.name), Q.F32

        rewrite_gguf(dst, f, tensors())
    return dst


def requantize_gguf(
    src: Path, dst: Path, preferred: int = Q.Q4_K, fallback: int = Q.Q4_0, embedding: int = Q.Q8_0
) -> dict[str, str]:
    """Write `src` with each 2-D weight requantized (`preferred` where the row length allows, else `fallback`).

    1-D tensors (norms) stay F32; the embedding / lm_head becomes `embedding`. Returns name -> type name.
    """
    chosen: dict[str, str] = {}
    with GGUFFile(src) as f:

        def tensors() -> Iterator[tuple[str, np.ndarray, int]]:
            for info, _ in f.iter_tensors():
                if len(info.shape) < 2:
                    data, qtype = f.tensor_f32(info.name), Q.F32
                elif info.name in EMBEDDING_TENSORS:
                    qtype, data = embedding, quant.quantize(f.tensor_f32(info.name), embedding)
                else:
                    qtype, data = quant.requantize(f.tensor_f32(info.name), preferred, fallback)
                chosen[info.name] = Q(qtype).name
                yield info.name, data, qtype

        rewrite_gguf(dst, f, tensors())
    return chosen
