"""Model hyper-parameters, built once from GGUF metadata and passed everywhere.

One ModelConfig describes every family distillery runs (llama incl. Llama 3 RoPE scaling and Mistral, qwen2,
qwen3, gemma3): what differs between them is data here (biases, q/k norm, RoPE variant and frequency factors, norm
placement, activation, embedding scale, attention scale, attention windows and their RoPE base, tied head), read
from the file by model/gguf_reader.py.

Gemma 3 as its GGUF stores it: every *norm.weight already holds 1 + w (convert_hf_to_gguf.py adds the 1 that HF's
Gemma3RMSNorm adds at run time), so its norms are the plain RMSNorm x * rstd * w_gguf of the other families.
"""

from __future__ import annotations

import math
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

# LoRA target short name -> HF/PEFT module path inside model.layers.N (the same for llama, mistral, qwen2, qwen3).
PEFT_MODULES: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}

# Targets that carry a bias in families with q/k/v biases (qwen2), in GGUF names blk.N.<stem>.bias.
BIAS_TARGETS = ("q", "k", "v")

# RoPE variants (llama.cpp's names): "norm" rotates adjacent pairs (x[2i], x[2i+1]); "neox" rotates halves
# (x[i], x[i + D/2]), as HF's rotate_half.
ROPE_TYPES = ("norm", "neox")


@dataclass(frozen=True)
class Family:
    """What an architecture fixes: its RoPE variant, whether q/k/v biases and per-head q/k RMSNorm are part of it,
    whether its GGUF files store attn_q / attn_k rows permuted for llama.cpp's NORM RoPE, and the Gemma pieces:
    post-norms (a norm on each branch's output before its residual add), the gate activation, embeddings scaled
    by sqrt(hidden), sliding windows on every block but each `window_period`-th (with <arch>.attention.
    sliding_window), and linear RoPE scaling of the global blocks (<arch>.rope.scaling.type = linear)."""

    rope_type: str
    qkv_bias: bool
    qk_norm: bool
    qk_rows_permuted: bool
    post_norms: bool = False
    activation: str = "silu"
    scaled_embedding: bool = False
    window_period: int = 0
    linear_rope_scaling: bool = False


# general.architecture -> family. Mistral is `llama` in GGUF. convert_hf_to_gguf.py permutes q/k rows only for
# the llama family (LlamaModel.permute); qwen2/qwen3/gemma3 keep HF order and llama.cpp runs them with NEOX RoPE.
FAMILIES: dict[str, Family] = {
    "llama": Family(rope_type="norm", qkv_bias=False, qk_norm=False, qk_rows_permuted=True),
    "qwen2": Family(rope_type="neox", qkv_bias=True, qk_norm=False, qk_rows_permuted=False),
    "qwen3": Family(rope_type="neox", qkv_bias=False, qk_norm=True, qk_rows_permuted=False),
    "gemma3": Family(
        rope_type="neox",
        qkv_bias=False,
        qk_norm=True,
        qk_rows_permuted=False,
        post_norms=True,
        activation="gelu_tanh",
        scaled_embedding=True,
        window_period=6,
        linear_rope_scaling=True,
    ),
}

# Architectures we recognise but cannot run yet, and what is missing (the refusal names it).
UNSUPPORTED_FAMILIES: dict[str, str] = {
    "gemma2": "attention and final logit soft-capping are not implemented",
}

# Gate activations of the MLP: silu (SwiGLU: llama, qwen) and gelu_tanh (GeGLU with the tanh approximation of
# GELU: HF's gelu_pytorch_tanh, gemma).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (names follow the GGUF <arch>.* keys) and the family's per-model settings."""

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
    rope_type: str = "norm"  # one of ROPE_TYPES
    rope_freq_factors: tuple[float, ...] | None = None  # rope_freqs.weight: angle_i = pos * base^(-2i/D) / f_i
    qkv_bias: bool = False  # q, k, v projections add blk.N.attn_{q,k,v}.bias
    qk_norm: bool = False  # per-head RMSNorm of q and k (blk.N.attn_{q,k}_norm.weight [D]) before RoPE
    norm: str = "rms"  # RMSNorm x * rstd * w (the only form implemented)
    activation: str = "silu"  # the MLP gate: one of ACTIVATIONS, act(g) * u
    embedding_scale: float = 1.0  # token embeddings multiplied by this, in the embedding's dtype (1: none)
    attention_windows: tuple[int, ...] = ()  # per layer, 0 = full causal attention; () = every layer full
    post_norms: bool = False  # blk.N.post_attention_norm / post_ffw_norm on each branch's output (gemma)
    rope_local_base: float = 0.0  # RoPE base of the sliding-window layers (gemma3: 10000); 0 = rope_base
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by this ** -0.5; 0 = head_dim
    rope_linear_factor: float = 1.0  # linear RoPE scaling of the global blocks, angle / factor (gemma3 4B+: 8)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.norm != "rms":
            raise ValueError(f"ModelConfig.norm={self.norm!r} is not implemented (only 'rms')")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation={self.activation!r} is not one of {ACTIVATIONS}")
        if not self.embedding_scale > 0 or self.rope_local_base < 0 or self.query_pre_attn_scalar < 0:
            raise ValueError("embedding_scale must be > 0, rope_local_base and query_pre_attn_scalar >= 0")
        if not self.rope_linear_factor > 0 or (self.rope_linear_factor != 1.0 and self.rope_freq_factors):
            raise ValueError("rope_linear_factor must be > 0, and not beside rope_freq_factors")
        if self.attention_windows and (len(self.attention_windows) != self.n_layers or min(self.attention_windows) < 0):
            raise ValueError(
                f"attention_windows: {len(self.attention_windows)} entries (one >= 0 per layer, {self.n_layers})"
            )
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, head_dim/2 is {self.head_dim // 2}"
            )

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor on q . k: query_pre_attn_scalar ** -0.5 (gemma), else head_dim ** -0.5."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def window(self, layer: int) -> int:
        """Block `layer`'s attention window: a query at i sees keys j with i - j < window; 0 = full causal."""
        return self.attention_windows[layer] if self.attention_windows else 0

    def rope_of(self, layer: int | None = None) -> tuple[float, tuple[float, ...] | None]:
        """(base, frequency factors f_i: angle_i = pos * base^(-2i/D) / f_i, None = 1) of block `layer` (None: a
        global block): a sliding-window block with its own base is unscaled (as llama.cpp's rope_freq_*_swa);
        the others take Llama 3's factors, or linear scaling's (every f_i = rope_linear_factor)."""
        if layer is not None and self.rope_local_base and self.window(layer):
            return self.rope_local_base, None
        if self.rope_linear_factor != 1.0:
            return self.rope_base, (self.rope_linear_factor,) * (self.head_dim // 2)
        return self.rope_base, self.rope_freq_factors

    @property
    def rope_scaling(self) -> str:
        """'llama3' when frequency factors (rope_freqs.weight) scale the RoPE angles, 'linear' (gemma3 4B+: the
        global blocks' angles divided by rope_linear_factor), else 'none'."""
        if self.rope_linear_factor != 1.0:
            return "linear"
        return "none" if self.rope_freq_factors is None else "llama3"

    @property
    def qk_rows_permuted(self) -> bool:
        """attn_q / attn_k rows are stored permuted for llama.cpp's NORM RoPE (llama-family GGUFs)."""
        family = FAMILIES.get(self.arch)
        return family.qk_rows_permuted if family else self.rope_type == "norm"

    def hf_shape(self) -> dict[str, int | bool]:
        """This shape in the config names transformers' decoder configs share (LlamaConfig, Qwen3Config, ...)."""
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tied_embeddings,
        }

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

    def block_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """GGUF name -> numpy shape of every tensor block `layer` of this model has."""
        out = {f"blk.{layer}.{LORA_TARGETS[t]}.weight": self.target_shape(t) for t in LORA_TARGETS}
        out[f"blk.{layer}.attn_norm.weight"] = (self.hidden,)
        out[f"blk.{layer}.ffn_norm.weight"] = (self.hidden,)
        if self.qkv_bias:
            out.update({f"blk.{layer}.{LORA_TARGETS[t]}.bias": (self.target_shape(t)[0],) for t in BIAS_TARGETS})
        if self.qk_norm:
            out[f"blk.{layer}.attn_q_norm.weight"] = (self.head_dim,)
            out[f"blk.{layer}.attn_k_norm.weight"] = (self.head_dim,)
        if self.post_norms:
            out[f"blk.{layer}.post_attention_norm.weight"] = (self.hidden,)
            out[f"blk.{layer}.post_ffw_norm.weight"] = (self.hidden,)
        return out

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> numpy shape of every tensor a model file of this config holds (what a reader expects)."""
        out: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.vocab, self.hidden)}
        if self.rope_freq_factors is not None:
            out["rope_freqs.weight"] = (self.head_dim // 2,)
        for layer in range(self.n_layers):
            out.update(self.block_tensors(layer))
        out["output_norm.weight"] = (self.hidden,)
        if not self.tied_embeddings:
            out["output.weight"] = (self.vocab, self.hidden)
        return out

    def settings(self) -> dict[str, object]:
        """The family-specific settings, for `distillery inspect` and run reports."""
        return {
            "architecture": self.arch,
            "rope": self.rope_type,
            "rope_base": self.rope_base,
            "rope_scaling": self.rope_scaling,
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "norm": self.norm,
            "activation": self.activation,
            "embedding_scale": self.embedding_scale,
            "attention": "full causal" if not any(self.attention_windows) else list(self.attention_windows),
            "attention_scale": self.attention_scale,
            "rope_local_base": self.rope_local_base or self.rope_base,
            "post_norms": self.post_norms,
            "lm_head": "tied to token_embd" if self.tied_embeddings else "output.weight",
            "qk_rows": "permuted (llama.cpp NORM RoPE)" if self.qk_rows_permuted else "HF order",
        }
