"""The CPU training engine: LoRA distillation through model/reference.py's ops in float32 numpy (BLAS)."""

from cpu.engine import NumpyEngine

__all__ = ["NumpyEngine"]
