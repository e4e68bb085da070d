"""Numpy reference llama with LoRA: the oracle the GPU ops are checked against.

Written for clarity, not speed. Every op is a `<op>_forward` / `<op>_backward` pair on plain arrays, side by
side; the computation dtype follows the inputs (float64 for finite-difference checks, float32 for parity). The
backward is hand-written from the loss to every LoRA A and B; base weights are frozen (no dW, only dX = dY W).

Conventions: weights are keyed by GGUF tensor names with numpy shapes [out, in]; attn_q / attn_k rows are in
GGUF order. RoPE rotates pair i by pos * base^(-2i/D) / f_i (f = Llama 3's rope_freqs factors, else 1); the
pairs follow the family (ModelConfig.rope_type): llama.cpp's NORM (llama: adjacent (x[2i], x[2i+1]), on rows the
converter permuted) or NEOX (qwen2/qwen3: halves (x[i], x[i + D/2]), HF order). qwen2 adds q/k/v biases after
the projections; qwen3 RMS-normalises each head of q and k (weight [D]) before RoPE. GQA: query head h reads kv
head h // (Hq // Hkv). LoRA (PEFT): y = x W^T + b + s (x A^T) B^T. The KD losses live in model/kd.py and are
re-exported here.

gemma3 (ModelConfig fields, read from its GGUF): embeddings times sqrt(hidden) in the embedding's dtype; q/k norms;
a post-norm on each branch's output before its residual add (post_attention_norm, post_ffw_norm); GeGLU with
GELU's tanh form; scores scaled by query_pre_attn_scalar^-0.5; sliding-window blocks (a query at i sees keys
j in (i - window, i]) with their own RoPE base. Its GGUF norm weights already hold HF's 1 + w.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from model.config import BIAS_TARGETS, LORA_TARGETS, ModelConfig
from model.kd import KINDS, LossConfig, kd_loss_backward, kd_loss_forward, log_softmax, logsumexp

__all__ = [
    "KINDS",
    "LossConfig",
    "LoraPair",
    "attention_backward",
    "attention_forward",
    "check_group_constant",
    "embed",
    "embedding_forward",
    "forward",
    "gate_backward",
    "gate_forward",
    "geglu_backward",
    "geglu_forward",
    "greedy_generate",
    "init_lora",
    "kd_loss_backward",
    "kd_loss_forward",
    "linear_backward_input",
    "linear_forward",
    "log_softmax",
    "logsumexp",
    "lora_backward",
    "lora_forward",
    "lora_group_expand",
    "lora_group_pool",
    "lora_group_project",
    "loss_and_grads",
    "random_weights",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rope_args",
    "rope_backward",
    "rope_forward",
    "rope_inv_freq",
    "swiglu_backward",
    "swiglu_forward",
]


# ---------------------------------------------------------------- embedding (frozen: no backward)


def embedding_forward(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of table [V, H] at ids [T] (or [B, T]) -> [T, H] (or [B, T, H])."""
    return table[np.asarray(ids, dtype=np.intp)]


def embed(weights: Mapping[str, np.ndarray], cfg: ModelConfig, ids: np.ndarray) -> np.ndarray:
    """The block-0 input: token_embd rows at ids, times cfg.embedding_scale cast to the table's dtype (as HF's
    Gemma3TextScaledWordEmbedding multiplies by embed_scale.to(weight.dtype))."""
    table = weights["token_embd.weight"]
    x = embedding_forward(table, ids)
    return x if cfg.embedding_scale == 1.0 else x * np.asarray(cfg.embedding_scale, dtype=table.dtype)


# ---------------------------------------------------------------- RMSNorm (weight frozen: no dw)


def rmsnorm_forward(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * w, over the last axis."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * w


def rmsnorm_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * w
    return rstd * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))


# ---------------------------------------------------------------- RoPE (NORM: adjacent pairs; NEOX: halves)


def rope_inv_freq(head_dim: int, base: float, factors: np.ndarray | tuple[float, ...] | None = None) -> np.ndarray:
    """theta_i = base^(-2i/D) / f_i in float64 (f: Llama 3 frequency factors, rope_freqs.weight; None = 1)."""
    inv_freq = float(base) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return inv_freq if factors is None else inv_freq / np.asarray(factors, dtype=np.float64)


def rope_cos_sin(
    positions: np.ndarray, head_dim: int, base: float, dtype: np.dtype, factors: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """cos, sin [T, 1, D/2] of angle pos * theta_i; angles in float64, then cast to dtype."""
    angle = np.asarray(positions, dtype=np.float64)[:, None] * rope_inv_freq(head_dim, base, factors)[None, :]
    return np.cos(angle)[:, None, :].astype(dtype), np.sin(angle)[:, None, :].astype(dtype)


def _pair_slices(d: int, neox: bool) -> tuple[slice, slice]:
    """Where the two members of each rotated pair sit in a head of size d."""
    return (slice(0, d // 2), slice(d // 2, d)) if neox else (slice(0, d, 2), slice(1, d, 2))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    first, second = _pair_slices(x.shape[-1], neox)
    x0, x1 = x[..., first], x[..., second]
    y = np.empty_like(x)
    y[..., first] = x0 * cos - x1 * sin
    y[..., second] = x0 * sin + x1 * cos
    return y


def rope_forward(
    x: np.ndarray, positions: np.ndarray, base: float, factors: np.ndarray | None = None, neox: bool = False
) -> np.ndarray:
    """Rotate each pair of x [..., T, n_heads, D] by pos * theta_i (positions [T]); NORM pairs (x[2i], x[2i+1]),
    or NEOX pairs (x[i], x[i + D/2]) when `neox`."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype, factors)
    return _rotate(x, cos, sin, neox)


def rope_backward(
    dy: np.ndarray, positions: np.ndarray, base: float, factors: np.ndarray | None = None, neox: bool = False
) -> np.ndarray:
    """The transpose of a rotation is the rotation by the opposite angle."""
    cos, sin = rope_cos_sin(positions, dy.shape[-1], base, dy.dtype, factors)
    return _rotate(dy, cos, -sin, neox)


def rope_args(cfg: ModelConfig, layer: int | None = None) -> dict:
    """The keyword arguments rope_forward / rope_backward take for a model's block `layer` (base, factors, pair
    layout): that block's base and factors (cfg.rope_of: a sliding-window block's own base, linear or Llama 3
    scaling on the others); a global block's for None."""
    base, factors = cfg.rope_of(layer)
    return {"base": base, "factors": factors, "neox": cfg.rope_type == "neox"}


# ---------------------------------------------------------------- causal GQA attention


def _expand_kv(k: np.ndarray, n_heads: int) -> np.ndarray:
    """[..., T, Hkv, D] -> [..., T, Hq, D] with query head h reading kv head h // (Hq // Hkv)."""
    return np.repeat(k, n_heads // k.shape[-2], axis=-2)


def _reduce_kv(dk: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Sum the per-query-head gradients [..., T, Hq, D] back onto their kv heads -> [..., T, Hkv, D]."""
    *lead, hq, d = dk.shape
    return dk.reshape(*lead, n_kv_heads, hq // n_kv_heads, d).sum(axis=-2)


def _heads_first(x: np.ndarray) -> np.ndarray:
    """[..., T, H, D] -> [..., H, T, D] (a view): attention is one matmul per (sequence, head)."""
    return np.swapaxes(x, -3, -2)


def _t(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def attention_mask(t: int, window: int = 0) -> np.ndarray:
    """[T, T] True where query i must not see key j: j > i (causal), or i - j >= window when window > 0."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    return (j > i) | ((i - j >= window) if window else False)


def attention_probs(q: np.ndarray, k: np.ndarray, window: int = 0, scale: float | None = None) -> np.ndarray:
    """Masked softmax(scale q k^T) [..., Hq, T, T] (row = query position, column = key position); scale defaults
    to 1/sqrt(D), the mask is attention_mask(T, window)."""
    t, hq, d = q.shape[-3:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (_heads_first(q) @ _t(_heads_first(_expand_kv(k, hq)))) * scale
    s = np.where(attention_mask(t, window), -np.inf, s)
    s = s - np.max(s, axis=-1, keepdims=True)
    p = np.exp(s)
    return p / np.sum(p, axis=-1, keepdims=True)


def attention_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0, scale: float | None = None
) -> np.ndarray:
    """out [..., T, Hq, D] = P V with P = attention_probs(q, k, window, scale); q [..., T, Hq, D], k and v
    [..., T, Hkv, D] (leading axes: independent sequences)."""
    p = attention_probs(q, k, window, scale)
    return _heads_first(p @ _heads_first(_expand_kv(v, q.shape[-2])))


def attention_backward(
    dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv); the probabilities are recomputed, as the GPU does."""
    hq, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    p = attention_probs(q, k, window, scale)
    kk, vv = _heads_first(_expand_kv(k, hq)), _heads_first(_expand_kv(v, hq))
    do, qh = _heads_first(dout), _heads_first(q)
    dp = do @ _t(vv)
    dvv = _t(p) @ do
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))  # softmax backward (masked entries have p = 0)
    dq = (ds @ kk) * scale
    dkk = (_t(ds) @ qh) * scale
    return _heads_first(dq), _reduce_kv(_heads_first(dkk), hkv), _reduce_kv(_heads_first(dvv), hkv)


# ---------------------------------------------------------------- SwiGLU


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) as (1 + tanh(x / 2)) / 2: no overflow for any x, and one vectorised transcendental."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def swiglu_forward(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, silu(g) = g * sigmoid(g)."""
    return g * _sigmoid(g) * u


def swiglu_backward(dy: np.ndarray, g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dg, du); silu'(g) = sig(g) * (1 + g * (1 - sig(g)))."""
    sig = _sigmoid(g)
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * g * sig


# ---------------------------------------------------------------- GeGLU (GELU, tanh form)

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def _gelu_tanh(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gelu(g), gelu'(g)) with gelu(g) = g/2 (1 + tanh(c (g + a g^3))), c = sqrt(2/pi), a = 0.044715."""
    th = np.tanh(GELU_C * (g + GELU_A * g * g * g))
    d = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * GELU_C * (1.0 + 3.0 * GELU_A * g * g)
    return 0.5 * g * (1.0 + th), d


def geglu_forward(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gelu_tanh(g) * u (HF's gelu_pytorch_tanh gate, Gemma's MLP)."""
    return _gelu_tanh(g)[0] * u


def geglu_backward(dy: np.ndarray, g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dg, du) = (dy u gelu'(g), dy gelu(g))."""
    f, d = _gelu_tanh(g)
    return dy * u * d, dy * f


_GATES = {"silu": (swiglu_forward, swiglu_backward), "gelu_tanh": (geglu_forward, geglu_backward)}


def gate_forward(activation: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The MLP gate of ModelConfig.activation: swiglu_forward or geglu_forward."""
    return _GATES[activation][0](g, u)


def gate_backward(activation: str, dy: np.ndarray, g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dg, du) of gate_forward."""
    return _GATES[activation][1](dy, g, u)


# ---------------------------------------------------------------- linear (frozen) and LoRA


def linear_forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in] @ W^T, W [out, in]."""
    return x @ w.T


def linear_backward_input(dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dx = dy @ W (no dW: base weights are frozen)."""
    return dy @ w


@dataclass
class LoraPair:
    """One adapter: A [r, in], B [out, r]."""

    A: np.ndarray
    B: np.ndarray


def lora_forward(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """scale * (x A^T) B^T."""
    return scale * ((x @ a.T) @ b.T)


def lora_backward(
    dy: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dA, dB) with u = x A^T: dB = s dy^T u, du = s dy B, dA = du^T x, dx = du A."""
    u = x @ a.T
    du = scale * (dy @ b)
    return du @ a, du.T @ x, scale * (dy.T @ u)


def init_lora(
    cfg: ModelConfig,
    targets: list[str] | tuple[str, ...],
    r: int,
    seed: int,
    dtype: np.dtype = np.float32,
    group: int = 0,
) -> dict[tuple[int, str], LoraPair]:
    """PEFT init, every layer x target: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform a=sqrt(5)), B = 0.
    group > 0 (a mergeable adapter): one draw per group of `group` inputs, repeated over the group, so A is
    group-constant (lora_group_expand) with the same bound."""
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"init_lora: unknown LoRA targets {unknown}; known: {list(LORA_TARGETS)}")
    rng = np.random.default_rng(seed)
    lora = {}
    for layer in range(cfg.n_layers):
        for t in targets:
            n_out, n_in = cfg.target_shape(t)
            bound = 1.0 / math.sqrt(n_in)
            if group:
                pooled = rng.uniform(-bound, bound, size=(r, n_in // group))
                a = lora_group_expand(pooled, group).astype(dtype)
            else:
                a = rng.uniform(-bound, bound, size=(r, n_in)).astype(dtype)
            lora[(layer, t)] = LoraPair(A=a, B=np.zeros((n_out, r), dtype=dtype))
    return lora


# A mergeable adapter (QA-LoRA with sum pooling): A [r, in] constant over each group of g consecutive inputs, so
# x A^T = (x summed over each group) A_pooled^T and B A is constant over each group of a row of W (it folds into
# a quantization block's offset). The engines train it as an ordinary A whose gradient is projected: dA replaced
# by its group sum broadcast over the group, the gradient of the pooled parameter. AdamW is elementwise, so m, v
# and the update stay equal across a group and A stays group-constant step after step.


def lora_group_expand(pooled: np.ndarray, group: int) -> np.ndarray:
    """A_pooled [r, in / g] -> A [r, in], each value repeated over its group of g inputs."""
    return np.repeat(pooled, group, axis=-1)


def lora_group_pool(a: np.ndarray, group: int) -> np.ndarray:
    """A [r, in] -> its group sums [r, in / g] (in a multiple of g)."""
    r, n_in = a.shape
    if n_in % group:
        raise ValueError(f"{n_in} inputs are not a multiple of the group {group}")
    return a.reshape(r, n_in // group, group).sum(axis=-1)


def lora_group_project(da: np.ndarray, group: int) -> np.ndarray:
    """dA [r, in] -> each group's sum broadcast over the group: the gradient of a group-constant A's pooled
    value, laid out like A (the mergeable adapter's backward; the GPU's lora_group_sum)."""
    return lora_group_expand(lora_group_pool(da, group), group)


def check_group_constant(a: np.ndarray, group: int, what: str) -> None:
    """ValueError unless A is exactly constant over each group of `group` inputs (a mergeable adapter's A)."""
    r, n_in = a.shape
    if n_in % group:
        raise ValueError(f"{what}: {n_in} inputs are not a multiple of the group {group}")
    g = a.reshape(r, n_in // group, group)
    if not np.array_equal(g, np.broadcast_to(g[..., :1], g.shape)):
        raise ValueError(
            f"{what}: lora_A is not constant over groups of {group} inputs: not a mergeable adapter "
            "(lora.kind plain trained it?)"
        )


def _rows(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [rows, n]: a batch of sequences goes through a projection as one matrix product."""
    return x.reshape(-1, x.shape[-1])


def project_forward(
    x: np.ndarray, w: np.ndarray, pair: LoraPair | None, scale: float, bias: np.ndarray | None = None
) -> np.ndarray:
    """One projection of x [..., in]: linear (+ frozen bias) + LoRA when the target is adapted."""
    x2 = _rows(x)
    y = linear_forward(x2, w)
    if bias is not None:
        y = y + bias
    if pair is not None:
        y = y + lora_forward(x2, pair.A, pair.B, scale)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def project_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, pair: LoraPair | None, scale: float
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """(dx, (dA, dB) or None); dy [..., out], x [..., in] (the gradients sum over every row). A bias changes
    neither: it is frozen and its Jacobian with respect to x is zero."""
    dy2 = _rows(dy)
    dx = linear_backward_input(dy2, w)
    if pair is None:
        return dx.reshape(x.shape), None
    dx_lora, da, db = lora_backward(dy2, _rows(x), pair.A, pair.B, scale)
    return (dx + dx_lora).reshape(x.shape), (da, db)


# ---------------------------------------------------------------- transformer block


LoraMap = Mapping[tuple[int, str], LoraPair]


def _w(weights: Mapping[str, np.ndarray], layer: int, target: str) -> np.ndarray:
    return weights[f"blk.{layer}.{LORA_TARGETS[target]}.weight"]


def _bias(weights: Mapping[str, np.ndarray], cfg: ModelConfig, layer: int, target: str) -> np.ndarray | None:
    """blk.N.attn_{q,k,v}.bias of a model with q/k/v biases (qwen2), else None."""
    if not cfg.qkv_bias or target not in BIAS_TARGETS:
        return None
    return weights[f"blk.{layer}.{LORA_TARGETS[target]}.bias"]


def block_forward(
    x: np.ndarray,
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    layer: int,
    lora: LoraMap,
    scale: float,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """h = x + pa(o(attn(rope(qn(q(n1))), rope(kn(k(n1))), v(n1)))); out = h + pf(down(gate(g(n2), up(n2)))).

    qn / kn: per-head RMSNorm when cfg.qk_norm (else identity); q, k, v add their bias when cfg.qkv_bias; pa / pf:
    the post-norms when cfg.post_norms (else identity); gate: cfg.activation's; attention with the block's window,
    RoPE base and cfg.attention_scale. x is one sequence [T, H] or a batch [B, T, H] (positions 0..T-1 in each);
    returns (out, cache)."""
    lead, d = x.shape[:-1], cfg.head_dim
    pos = np.arange(x.shape[-2])
    rope = rope_args(cfg, layer)

    def proj(name: str, inp: np.ndarray) -> np.ndarray:
        w, pair = _w(weights, layer, name), lora.get((layer, name))
        return project_forward(inp, w, pair, scale, _bias(weights, cfg, layer, name))

    c: dict[str, np.ndarray] = {"x": x}
    c["n1"] = rmsnorm_forward(x, weights[f"blk.{layer}.attn_norm.weight"], cfg.eps)
    q = proj("q", c["n1"]).reshape(*lead, cfg.n_heads, d)
    k = proj("k", c["n1"]).reshape(*lead, cfg.n_kv_heads, d)
    if cfg.qk_norm:
        c["q0"], c["k0"] = q, k
        q = rmsnorm_forward(q, weights[f"blk.{layer}.attn_q_norm.weight"], cfg.eps)
        k = rmsnorm_forward(k, weights[f"blk.{layer}.attn_k_norm.weight"], cfg.eps)
    c["q"] = rope_forward(q, pos, **rope)
    c["k"] = rope_forward(k, pos, **rope)
    c["v"] = proj("v", c["n1"]).reshape(*lead, cfg.n_kv_heads, d)
    window, att_scale = cfg.window(layer), cfg.attention_scale
    c["att"] = attention_forward(c["q"], c["k"], c["v"], window, att_scale).reshape(*lead, cfg.q_dim)
    o = proj("o", c["att"])
    if cfg.post_norms:
        c["o"] = o
        o = rmsnorm_forward(o, weights[f"blk.{layer}.post_attention_norm.weight"], cfg.eps)
    c["h"] = x + o
    c["n2"] = rmsnorm_forward(c["h"], weights[f"blk.{layer}.ffn_norm.weight"], cfg.eps)
    c["g"], c["u"] = proj("gate", c["n2"]), proj("up", c["n2"])
    c["act"] = gate_forward(cfg.activation, c["g"], c["u"])
    down = proj("down", c["act"])
    if cfg.post_norms:
        c["down"] = down
        down = rmsnorm_forward(down, weights[f"blk.{layer}.post_ffw_norm.weight"], cfg.eps)
    return c["h"] + down, c


def block_backward(
    dout: np.ndarray,
    c: Mapping[str, np.ndarray],
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    layer: int,
    lora: LoraMap,
    scale: float,
    grads: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]],
) -> np.ndarray:
    """d block input (dout [T, H] or [B, T, H]); LoRA gradients of this layer are written into grads."""
    lead = dout.shape[:-1]
    pos = np.arange(dout.shape[-2])
    rope = rope_args(cfg, layer)

    def proj_back(name: str, dy: np.ndarray, inp: np.ndarray) -> np.ndarray:
        dx, g = project_backward(dy, inp, _w(weights, layer, name), lora.get((layer, name)), scale)
        if g is not None:
            grads[(layer, name)] = g
        return dx

    # MLP half: out = h + pf(down(gate(g(n2), up(n2))))
    ddown = dout
    if cfg.post_norms:
        ddown = rmsnorm_backward(dout, c["down"], weights[f"blk.{layer}.post_ffw_norm.weight"], cfg.eps)
    dact = proj_back("down", ddown, c["act"])
    dg, du = gate_backward(cfg.activation, dact, c["g"], c["u"])
    dn2 = proj_back("gate", dg, c["n2"]) + proj_back("up", du, c["n2"])
    dh = dout + rmsnorm_backward(dn2, c["h"], weights[f"blk.{layer}.ffn_norm.weight"], cfg.eps)
    # attention half: h = x + pa(o(attn(...)))
    do = dh
    if cfg.post_norms:
        do = rmsnorm_backward(dh, c["o"], weights[f"blk.{layer}.post_attention_norm.weight"], cfg.eps)
    datt = proj_back("o", do, c["att"]).reshape(*lead, cfg.n_heads, cfg.head_dim)
    dq, dk, dv = attention_backward(datt, c["q"], c["k"], c["v"], cfg.window(layer), cfg.attention_scale)
    dq, dk = rope_backward(dq, pos, **rope), rope_backward(dk, pos, **rope)
    if cfg.qk_norm:
        dq = rmsnorm_backward(dq, c["q0"], weights[f"blk.{layer}.attn_q_norm.weight"], cfg.eps)
        dk = rmsnorm_backward(dk, c["k0"], weights[f"blk.{layer}.attn_k_norm.weight"], cfg.eps)
    dq, dk = dq.reshape(*lead, cfg.q_dim), dk.reshape(*lead, cfg.kv_dim)
    dn1 = proj_back("q", dq, c["n1"]) + proj_back("k", dk, c["n1"]) + proj_back("v", dv.reshape(*lead, -1), c["n1"])
    return dh + rmsnorm_backward(dn1, c["x"], weights[f"blk.{layer}.attn_norm.weight"], cfg.eps)


# ---------------------------------------------------------------- whole model


def lm_head_weight(weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """output.weight, or token_embd.weight when the embeddings are tied."""
    return weights["output.weight"] if "output.weight" in weights else weights["token_embd.weight"]


def _forward_cached(
    weights: Mapping[str, np.ndarray], cfg: ModelConfig, ids: np.ndarray, lora: LoraMap | None, scale: float
) -> tuple[np.ndarray, list[dict[str, np.ndarray]], np.ndarray]:
    """(logits, per-layer caches, final hidden state before output_norm)."""
    x = embed(weights, cfg, ids)
    caches = []
    for layer in range(cfg.n_layers):
        x, c = block_forward(x, weights, cfg, layer, lora or {}, scale)
        caches.append(c)
    n = rmsnorm_forward(x, weights["output_norm.weight"], cfg.eps)
    return linear_forward(n, lm_head_weight(weights)), caches, x


def forward(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    lora: LoraMap | None = None,
    lora_scale: float = 1.0,
) -> np.ndarray:
    """logits [T, V] for token ids [T] (positions 0..T-1); [B, T, V] for a batch of ids [B, T]."""
    return _forward_cached(weights, cfg, ids, lora, lora_scale)[0]


def loss_and_grads(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    lora: LoraMap | None,
    lora_scale: float,
    teacher_ids: np.ndarray,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    targets: np.ndarray,
    mask: np.ndarray,
    loss_cfg: LossConfig,
    lora_group: int = 0,
    teacher_counts: np.ndarray | None = None,
) -> tuple[float, dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]]:
    """(loss, {(layer, target): (dA, dB)}) by the hand-written backward.

    One sequence (ids [T], teacher arrays [T, k] / [T]) or a batch (ids [B, T], [B, T, k] / [B, T]): the loss
    is the mean over every masked position of the batch. lora_group > 0 (a mergeable adapter): each dA is
    projected by lora_group_project, the gradient with respect to A's group values. teacher_counts ([T, k] or
    [B, T, k]): the sampled store's counts (loss_cfg.samples > 0; model/kd.py)."""
    logits, caches, x = _forward_cached(weights, cfg, ids, lora, lora_scale)
    k = np.shape(teacher_ids)[-1]
    flat = logits.reshape(-1, logits.shape[-1])
    args = (
        np.reshape(teacher_ids, (-1, k)),
        np.reshape(teacher_logprobs, (-1, k)),
        None if teacher_tail is None else np.reshape(teacher_tail, -1),
        np.reshape(targets, -1),
        np.reshape(mask, -1),
        loss_cfg,
    )
    counts = None if teacher_counts is None else np.reshape(teacher_counts, (-1, k))
    loss = kd_loss_forward(flat, *args, teacher_counts=counts)
    dlogits = kd_loss_backward(flat, *args, teacher_counts=counts).reshape(logits.shape)
    dn = linear_backward_input(dlogits, lm_head_weight(weights))
    dx = rmsnorm_backward(dn, x, weights["output_norm.weight"], cfg.eps)
    grads: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for layer in reversed(range(cfg.n_layers)):
        dx = block_backward(dx, caches[layer], weights, cfg, layer, lora or {}, lora_scale, grads)
    if lora_group:
        grads = {key: (lora_group_project(da, lora_group), db) for key, (da, db) in grads.items()}
    return loss, grads


def greedy_generate(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: list[int] | np.ndarray,
    n_new: int,
    lora: LoraMap | None = None,
    lora_scale: float = 1.0,
) -> list[int]:
    """The n_new greedily generated ids (prompt not included); recomputes the whole prefix each step."""
    seq = [int(i) for i in ids]
    for _ in range(n_new):
        seq.append(int(np.argmax(forward(weights, cfg, np.array(seq), lora, lora_scale)[-1])))
    return seq[len(seq) - n_new :]


def random_weights(cfg: ModelConfig, seed: int, dtype: np.dtype = np.float64) -> dict[str, np.ndarray]:
    """Random GGUF-named weights for a tiny config, scaled so activations and logits stay O(1): every tensor of
    cfg.tensor_shapes() (biases, q/k norms, post-norms and rope_freqs.weight when the family has them). Norm
    weights are 1 + noise, as GGUF stores Gemma's (1 + w) too."""
    rng = np.random.default_rng(seed)
    h = cfg.hidden

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(dtype)

    def norm_weight(n: int = h) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    w = {"token_embd.weight": normal((cfg.vocab, h), h**-0.25)}
    if cfg.rope_freq_factors is not None:
        w["rope_freqs.weight"] = np.asarray(cfg.rope_freq_factors, dtype=dtype)
    for layer in range(cfg.n_layers):
        w[f"blk.{layer}.attn_norm.weight"] = norm_weight()
        w[f"blk.{layer}.ffn_norm.weight"] = norm_weight()
        for t, stem in LORA_TARGETS.items():
            n_out, n_in = cfg.target_shape(t)
            gain = 0.5 if t in ("o", "down") else 1.0  # residual branches a bit smaller
            w[f"blk.{layer}.{stem}.weight"] = normal((n_out, n_in), gain / np.sqrt(n_in))
            if cfg.qkv_bias and t in BIAS_TARGETS:
                w[f"blk.{layer}.{stem}.bias"] = normal((n_out,), 0.5)
        if cfg.qk_norm:
            w[f"blk.{layer}.attn_q_norm.weight"] = norm_weight(cfg.head_dim)
            w[f"blk.{layer}.attn_k_norm.weight"] = norm_weight(cfg.head_dim)
        if cfg.post_norms:
            w[f"blk.{layer}.post_attention_norm.weight"] = norm_weight()
            w[f"blk.{layer}.post_ffw_norm.weight"] = norm_weight()
    w["output_norm.weight"] = norm_weight()
    if not cfg.tied_embeddings:
        w["output.weight"] = normal((cfg.vocab, h), 1.0 / np.sqrt(h))
    return w
