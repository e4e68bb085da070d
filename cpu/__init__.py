"""The CPU training engine: LoRA training through model/reference.py's ops in float32 numpy (BLAS), with the
objective it optimises plugged in (cpu/objectives.py)."""

from cpu.engine import NumpyEngine
from cpu.objectives import NumpyKd, NumpyPreference

__all__ = ["NumpyEngine", "NumpyKd", "NumpyPreference"]
