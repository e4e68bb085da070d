"""Model hyper-parameters, built once from GGUF metadata and passed everywhere."""

from __future__ import annotations

from dataclasses import dataclass

# LoRA target short names (PEFT module names) -> GGUF tensor stem inside a block.
LORA_TARGETS: dict[str, str] = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}

# LoRA target short name -> HF/PEFT module path inside model.layers.N.
PEFT_MODULES: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyper-parameters (names follow the GGUF llama.* keys)."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    head_dim: int = 0  # 0 -> hidden // n_heads
    rope_base: float = 10000.0
    eps: float = 1e-5
    context_length: int = 2048
    tied_embeddings: bool = True
    arch: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def target_shape(self, target: str) -> tuple[int, int]:
        """(out_features, in_features) of the projection a LoRA target adapts."""
        h, f = self.hidden, self.ffn
        return {
            "q": (self.q_dim, h),
            "k": (self.kv_dim, h),
            "v": (self.kv_dim, h),
            "o": (h, self.q_dim),
            "gate": (f, h),
            "up": (f, h),
            "down": (h, f),
        }[target]
