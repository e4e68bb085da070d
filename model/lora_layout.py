"""The LoRA parameters of a student as one flat float32 vector: where each (layer, target) A [r, d_in] and
B [d_out, r] live. Both engines keep parameters, gradients and AdamW moments in this order (the GPU's AdamW runs
over one buffer; offsets are aligned to the 256-byte storage-offset alignment), so adapters and optimizer state
move between engines unchanged. Pure numpy: importing it needs no GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from model.config import LORA_TARGETS, ModelConfig
from model.reference import LoraPair

FLOATS_PER_SLOT_ALIGN = 64  # 256-byte storage offset alignment, in f32 elements


def aligned_floats(n: int, align: int = FLOATS_PER_SLOT_ALIGN) -> int:
    """n f32 elements rounded up so that the next tensor starts at an aligned storage offset."""
    return -(-n // align) * align


# ---- LoRA parameters: one flat f32 buffer (AdamW runs over it), each tensor at an aligned offset ----------
@dataclass(frozen=True)
class LoraSlot:
    layer: int
    target: str
    d_in: int
    d_out: int
    a_off: int  # element offset of A [r, d_in]
    b_off: int  # element offset of B [d_out, r]


@dataclass(frozen=True)
class LoraLayout:
    """Where each (layer, target) A and B live in the flat parameter / gradient buffers."""

    r: int
    slots: dict[tuple[int, str], LoraSlot]
    n_params: int  # including alignment padding (padding stays zero: zero grads, zero updates)

    @classmethod
    def build(cls, cfg: ModelConfig, targets: Iterable[str], r: int, layers: Iterable[int] | None = None) -> LoraLayout:
        targets = [t for t in LORA_TARGETS if t in set(targets)]
        layers = sorted(set(range(cfg.n_layers) if layers is None else layers))
        if layers and not 0 <= layers[0] <= layers[-1] < cfg.n_layers:
            raise ValueError(f"lora layers {layers} outside the model's blocks 0..{cfg.n_layers - 1}")
        slots, off = {}, 0
        for layer in layers:
            for t in targets:
                d_out, d_in = cfg.target_shape(t)
                a_off, off = off, off + aligned_floats(r * d_in)
                b_off, off = off, off + aligned_floats(d_out * r)
                slots[(layer, t)] = LoraSlot(layer, t, d_in, d_out, a_off, b_off)
        return cls(r, slots, off)

    @property
    def lowest_layer(self) -> int:
        """The lowest adapted block: the backward stops there."""
        return min((layer for layer, _ in self.slots), default=0)

    def pack(self, adapter: Mapping[tuple[int, str], LoraPair]) -> np.ndarray:
        flat = np.zeros(self.n_params, np.float32)
        for key, s in self.slots.items():
            pair = adapter[key]
            flat[s.a_off : s.a_off + self.r * s.d_in] = np.asarray(pair.A, np.float32).reshape(-1)
            flat[s.b_off : s.b_off + s.d_out * self.r] = np.asarray(pair.B, np.float32).reshape(-1)
        return flat

    def unpack(self, flat: np.ndarray) -> dict[tuple[int, str], LoraPair]:
        r = self.r
        return {
            key: LoraPair(
                flat[s.a_off : s.a_off + r * s.d_in].reshape(r, s.d_in).copy(),
                flat[s.b_off : s.b_off + s.d_out * r].reshape(s.d_out, r).copy(),
            )
            for key, s in self.slots.items()
        }
