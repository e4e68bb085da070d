"""Kept blocks: the blocks whose intermediates the forward keeps for the backward, which then skips their
recompute (gradient checkpointing off for them). Memory for speed: a recomputed block repeats its q/k/v, o and
gate/up GEMMs and its attention forward in the backward; a kept block holds, per token, its RoPE'd q and k, v,
the attention output and its log-sum-exp, the residual after attention and the gate and up outputs in f32
(`kept_widths`; Llama-3-8B: 172,160 bytes a token a block, 0.71 GB a block at 4 x 1,024 tokens). Its RMSNorm
outputs and the gated activation are recomputed from those (three element-wise passes).

train.kept_blocks: a number of blocks (clipped to those a backward recomputes: the adapted blocks but the top
one), or auto: as many as fit in the device's memory after what the process already holds and a reserve
(gpu/headroom.py); none where the device does not report its memory. A kept block's
backward reads the forward's own intermediates: on the f32 path bitwise what a recompute gives, with bf16
checkpoints (the tensor-core default) closer to exact than a recompute from the rounded block input.
"""

from __future__ import annotations

from gpu.headroom import free_bytes
from model.config import ModelConfig

KEPT_AUTO = "auto"


def kept_widths(cfg: ModelConfig) -> dict[str, int]:
    """Per-row widths (f32) of a kept block's own buffers, by the name of the scratch buffer they stand in for:
    what its backward reads that a cheap element-wise pass cannot give back."""
    widths = {"qr": cfg.q_dim, "kr": cfg.kv_dim, "v": cfg.kv_dim, "att": cfg.q_dim, "hres": cfg.hidden}
    widths.update({"g": cfg.ffn, "u": cfg.ffn})
    if cfg.qk_norm:  # the per-head norms' inputs, read by their backward
        widths.update({"q": cfg.q_dim, "k": cfg.kv_dim})
    if cfg.post_norms:  # the o and down outputs before their post-norms, read by theirs
        widths.update({"o": cfg.hidden, "down": cfg.hidden})
    return widths


def kept_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes one kept block costs per token: its kept_widths in f32 and one log-sum-exp a head."""
    return 4 * (sum(kept_widths(cfg).values()) + cfg.n_heads)


def kept_count(
    setting: int | str,
    recomputed: int,
    block_bytes: int,
    device_bytes: int | None,
    held_bytes: int,
    share: float = 1.0,
) -> int:
    """How many of the `recomputed` blocks keep their intermediates: `setting` itself (an int, clipped), or for
    auto as many blocks of block_bytes as gpu/headroom.py's free_bytes allows (0 when device_bytes is None: not
    reported). share < 1: this engine has that fraction of the GPU (data-parallel workers sharing one)."""
    if isinstance(setting, bool) or not (setting == KEPT_AUTO or isinstance(setting, int)):
        raise ValueError(f"kept_blocks={setting!r}: expected a number of blocks >= 0 or {KEPT_AUTO!r}")
    if setting != KEPT_AUTO:
        if setting < 0:
            raise ValueError(f"kept_blocks={setting}: expected a number of blocks >= 0 or {KEPT_AUTO!r}")
        return min(int(setting), recomputed)
    if block_bytes <= 0:
        return 0
    return min(recomputed, free_bytes(device_bytes, held_bytes, share) // block_bytes)
