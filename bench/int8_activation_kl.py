"""What 8-bit projections do to a real student's held-out KL, per choice of activation scale, as JSON (numpy).

    python bench/precision_quality.py configs/demo.yaml --until teacher     # the demo's workdir, once
    python bench/int8_activation_kl.py configs/demo.yaml --prepared runs/demo/prepared.json

The integer path rounds each projection's input to 8 bits of a scale and its weight to 8 bits of its row's max
(gpu/ops/matmul_i8.py; model/int8.py is the twin). This evaluates the untrained student (the baseline of
bench/precision_quality.py: no adapter) on the held-out split with the numpy engine, every projection's product
x W^T replaced by the product of the rounded operands (the LM head stays exact, as on the GPU), per variant:
- `exact`: no rounding (the f32 baseline);
- `row`: x per row, W per row (what the GPU does);
- `chunkN`: x per row and chunk of (at most) N inputs (the GEMM's chunked variant), W per row;
- `smoothA`: x / s and W * s per input channel before the per-row rounding, s_j = max|x_j|^A / max|W_j|^(1 - A)
  (SmoothQuant), the channel maxima of x from the batch itself (an upper bound on a calibrated s);
  `smoothA:chunkN` both;
- `hadamardN`: x and W rotated along the reduction axis, (x R)(W R)^T = x W^T, before the per-row rounding, R the
  GPU's rotation (model/int8.py hadamard_rows: pseudo-random signs, then the orthonormal Walsh-Hadamard matrix of
  size N in diagonal blocks; QuaRot's idea: a rotation spreads an outlier channel over N inputs, so one row scale
  fits all of them); `hadamardN:chunkM` both; `hadamardN:weights` /
  `hadamardN:inputs` one operand rounded; `orthogonal`: a dense random orthogonal rotation of the whole input
  instead (what a rotation can do at best); `hadamardN:residual`: x as two 8-bit terms (its codes,
  then those of what they miss: two integer GEMMs); any variant `:onlyW` / `:shapeOxI`: only the projections with
  inputs of width W / weights of that shape; any variant ending in `:head`: the student's logits rounded too (the
  LM head's forward product; its backward stays exact, as on the GPU); any variant ending in `:dh-rn` or `:dh-sr`
  (after `:head`, if any): the head's backward too, each chunk's softmax-weighted sum of W's rows (exp(z - m) W_c,
  the GPU's f16 "nn" GEMM) as an integer product would take it: W_c rotated and rounded per row (the logits'
  codes), exp(z - m) times W's row scales rounded per row to 8 bits, to nearest (`rn`) or stochastically (`sr`:
  floor(y + u), u uniform in [0, 1): unbiased), the sum rotated back; any variant ending in `:lora8` (last): the
  adapters' t = x A^T too from x and A rotated like the projection's operands and rounded per row (an integer thin
  product over the codes the projection already has), in the forward and in dB = s dY^T t; any variant ending in
  `:dt8` (after `:lora8`, if any): the adapters' dt = s dY B too from the codes the input gradient's integer GEMM
  takes (dY times W's row scales sW, rounded per row) against B / sW rounded per rank column; `:g8` (after `:dt8`):
  dB and dA from codes too, reduced over the rows (dt8_backward);
- `weights`: W rounded, x exact; `inputs`: x per row, W exact.
Rows: per variant the held-out KL, top-1 agreement and CE, and KL relative to the first variant. With --train each
variant first trains the demo's adapter through its rounding (numpy engine, exact gradients) and the trained
adapter is evaluated: bench/precision_quality.py's gate on a CPU, for the forward's rounding alone (with
--eval-exact through the exact products: the trained adapter's quality apart from the evaluation's own rounding).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages.train  # noqa: E402
from bench.precision_quality import prepare  # noqa: E402
from cpu.head import VocabHead  # noqa: E402
from model import reference  # noqa: E402
from model.int8 import dequantize_i8, hadamard_rows, quantize_i8  # noqa: E402
from schemas.config import load_config  # noqa: E402
from stages.layout import workdir  # noqa: E402
from training.evaluation import evaluate  # noqa: E402

Linear = Callable[[np.ndarray, np.ndarray], np.ndarray]
G8_ROWS = 256  # `:g8`: rows per column scale of the thin operands of dB and dA


def rounded(x: np.ndarray, chunk: int = 0) -> np.ndarray:
    """x [rows, k] rounded to 8 bits of each row's (or row chunk's) max |value|: chunks of the largest multiple
    of 32 up to `chunk` that divides k."""
    x = np.asarray(x, np.float32)
    k = x.shape[1]
    size = max((c for c in range(32, min(chunk, k) + 1, 32) if k % c == 0), default=k) if chunk else k
    return dequantize_i8(*quantize_i8(x, size))


@functools.cache
def _orthogonal(k: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(k).standard_normal((k, k)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def dh_product(mode: str, seed: int = 0) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """The `:dh-rn` / `:dh-sr` weighted sum out = p W_c (cpu/head.py VocabHead.weighted_rows) through 8-bit
    operands (module docstring)."""
    rng = np.random.default_rng(seed)

    def product(p: np.ndarray, w_c: np.ndarray, out: np.ndarray) -> None:
        k = w_c.shape[1]
        size = min(128, k & -k)
        codes, sw = quantize_i8(hadamard_rows(w_c, size), k)
        a = p * sw.reshape(1, -1)
        sa = np.abs(a).max(axis=1, keepdims=True) / np.float32(127)
        y = a / np.where(sa > 0, sa, np.float32(1))
        q = np.round(y) if mode == "rn" else np.floor(y + rng.random(y.shape, np.float32))
        t = (np.clip(q, -127, 127) * sa).astype(np.float32) @ codes.astype(np.float32)
        out[...] = hadamard_rows(t, size, back=True)

    return product


def lora8_pair(variant: str) -> tuple[Callable, Callable]:
    """reference.lora_forward / lora_backward with t = x A^T from 8-bit rotated operands (`:lora8`; the rotation
    of `variant`'s hadamardN, else none)."""
    name = variant.split(":")[0]
    size = int(name[8:]) if name.startswith("hadamard") else 0

    def t_of(x: np.ndarray, a: np.ndarray) -> np.ndarray:
        if x.shape[1] % 32:
            return x @ a.T
        n = min(size, x.shape[1] & -x.shape[1]) if size else 0
        xr, ar = (hadamard_rows(x, n), hadamard_rows(a, n)) if n else (x, a)
        return rounded(xr) @ rounded(ar).T

    def forward(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
        return scale * (t_of(x, a) @ b.T)

    def backward(dy: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> tuple:
        du = scale * (dy @ b)
        return du @ a, du.T @ x, scale * (dy.T @ t_of(x, a))

    return forward, backward


def dt8_backward(variant: str, grads8: bool = False) -> Callable:
    """reference.project_backward with the LoRA's dt = s dY B from 8-bit operands (`:dt8`): the codes of dY * sW per
    row (what the input gradient's integer GEMM takes; sW the row scales of W's rotated codes) times B / sW rounded
    per rank column (dt = s sum_o (dY sW)[m, o] (B / sW)[o, n]); dB and dA as the current reference computes them,
    or with grads8 (`:g8`) from codes too, summed over the rows: dB = (s / sW[o]) sum_m qdY[m, o] u[m, n] with
    u = sdY[m] t[m, n] rounded per column over chunks of G8_ROWS rows (qdY, sdY: dY sW's codes and row scales), and
    dA = (sum_m v[m, n] qx[m, k]) R^T with v = sx[m] dt[m, n] rounded so (qx, sx: x's rotated codes and row scales)."""
    name = variant.split(":")[0]
    size = int(name[8:]) if name.startswith("hadamard") else 0
    exact = reference.project_backward

    def rotation(k: int) -> int:
        return min(size, k & -k) if size else 0

    def column_rounded(v: np.ndarray) -> np.ndarray:  # v [rows, r] rounded per column over chunks of rows
        return rounded(v.T, G8_ROWS).T

    def grads_from_codes(dy_sw: np.ndarray, safe: np.ndarray, x2: np.ndarray, du: np.ndarray, a: np.ndarray,
                         scale: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        n = rotation(x2.shape[1])
        xr = hadamard_rows(x2, n) if n else x2
        qx, sx = quantize_i8(xr, xr.shape[1])
        t = rounded(xr) @ rounded(hadamard_rows(a, n) if n else a).T  # the forward's t (`:lora8`)
        qdy, sdy = quantize_i8(dy_sw, dy_sw.shape[1])
        db = scale / safe[:, None] * (qdy.T.astype(np.float32) @ column_rounded(sdy * t))
        da = column_rounded(sx * du).T @ qx.astype(np.float32)
        return (hadamard_rows(da, n, back=True) if n else da), db

    def backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, pair: reference.LoraPair | None, scale: float) -> tuple:
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        if pair is None or dy2.shape[1] % 32 or w.shape[1] % 32:
            return exact(dy, x, w, pair, scale)
        n = min(size, w.shape[1] & -w.shape[1]) if size else 0
        sw = np.abs(hadamard_rows(w, n) if n else w).max(axis=1) / 127.0
        safe = np.where(sw > 0, sw, 1.0).astype(np.float32)
        codes = rounded(dy2 * sw[None, :])
        du = scale * (codes @ rounded((pair.B / safe[:, None]).T).T)
        dx = reference.linear_backward_input(dy2, w) + du @ pair.A
        if grads8 and x2.shape[1] % 32 == 0 and dy2.shape[0] % 32 == 0:
            return dx.reshape(x.shape), grads_from_codes(dy2 * safe[None, :], safe, x2, du, pair.A, scale)
        _, _, db = reference.lora_backward(dy2, x2, pair.A, pair.B, scale)
        return dx.reshape(x.shape), (du.T @ x2, db)

    return backward


def variant_linear(variant: str, vocab: int, exact: Linear) -> Linear:
    """The projection product for `variant` (the LM head, W with `vocab` rows, stays exact unless the variant ends
    in `:head`: its logits rounded like the projections, as gpu/ops/head.py INT8_STUDENT_LOGITS)."""
    for suffix in (":g8", ":dt8", ":lora8", ":dh-rn", ":dh-sr"):
        variant = variant.removesuffix(suffix)
    head = variant.endswith(":head")
    name, _, only = variant.removesuffix(":head").partition(":only")  # only the inputs of this width rounded
    name, _, shape = name.partition(":shape")  # only the projections of this OUTxIN weight shape rounded

    def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if name == "exact" or (w.shape[0] == vocab and not head) or x.shape[1] % 32:
            return exact(x, w)
        if only and x.shape[1] != int(only):
            return exact(x, w)
        if shape and "x".join(map(str, w.shape)) != shape:
            return exact(x, w)
        if name == "weights":
            return exact(x, rounded(w))
        if name == "inputs":
            return exact(rounded(x), w)
        if name == "row":
            return exact(rounded(x), rounded(w))
        if name.startswith("chunk"):
            return exact(rounded(x, int(name[5:])), rounded(w))
        if name == "orthogonal":  # a dense random orthogonal rotation of the whole input (an upper bound on rotations)
            r = _orthogonal(x.shape[1])
            return exact(rounded(x @ r), rounded(w @ r))
        if name.startswith("hadamard"):
            size, _, rest = name[8:].partition(":")
            size = min(int(size), x.shape[1] & -x.shape[1])
            xr, wr = hadamard_rows(x, size), hadamard_rows(w, size)
            if rest == "residual":  # x as two 8-bit terms (codes of x, then of what they miss), W rounded
                first = rounded(xr)
                return exact(first + rounded(xr - first), rounded(wr))
            if rest in ("weights", "inputs"):
                return exact(xr, rounded(wr)) if rest == "weights" else exact(rounded(xr), wr)
            return exact(rounded(xr, int(rest.removeprefix("chunk") or 0)), rounded(wr))
        if name.startswith("smooth"):
            alpha, _, chunk = name[6:].partition(":chunk")
            xm = np.maximum(np.abs(x).max(axis=0), 1e-8)
            wm = np.maximum(np.abs(w).max(axis=0), 1e-8)
            s = (xm ** float(alpha) / wm ** (1.0 - float(alpha))).astype(np.float32)
            return exact(rounded(x / s, int(chunk or 0)), rounded(w * s))
        raise SystemExit(f"bench/int8_activation_kl.py: unknown variant {name!r}")

    return linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="the run config (e.g. configs/demo.yaml)")
    ap.add_argument("--prepared", required=True, help="prepared.json of bench/precision_quality.py --until teacher")
    ap.add_argument("--variants", default="exact,row,inputs,weights,chunk128,chunk64,chunk32,smooth0.5,smooth0.8")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config overrides")
    ap.add_argument(
        "--train",
        action="store_true",
        help="train the demo through each variant first (numpy engine: its forward rounded, its gradients exact), "
        "then evaluate the trained adapter (the GPU gate's question with f32 input gradients; minutes a variant)",
    )
    ap.add_argument(
        "--eval-exact",
        action="store_true",
        help="with --train: evaluate each trained adapter through the exact products (what the adapter carries to "
        "a higher-precision runtime), not through the variant's rounding",
    )
    args = ap.parse_args()
    cfg = load_config(args.config, [*args.set, "train.backend=numpy"])
    m = prepare(cfg, args.prepared)
    tokens, student, teacher = m["tokens"], m["student"], m["teacher"]
    root = workdir(cfg)
    where = {"student_gguf": student.path_in(root), "token_dir": tokens.path_in(root)}
    where["topk_dir"] = teacher.path_in(root)
    exact, exact_logits = reference.linear_forward, VocabHead.__dict__["logits"]  # the staticmethod itself
    exact_sum = VocabHead.__dict__["weighted_rows"]
    exact_lora = reference.lora_forward, reference.lora_backward
    exact_back = reference.project_backward
    first = None
    for name in (v for v in args.variants.split(",") if v):
        reference.linear_forward = variant_linear(name, tokens.vocab_size, exact)
        base = name.removesuffix(":g8").removesuffix(":dt8")
        if name.removesuffix(":g8").endswith(":dt8"):
            reference.project_backward = dt8_backward(name, grads8=name.endswith(":g8"))
        if base.endswith(":lora8"):
            reference.lora_forward, reference.lora_backward = lora8_pair(base)
        base = base.removesuffix(":lora8")
        if base.removesuffix(":dh-rn").removesuffix(":dh-sr").endswith(":head"):  # the numpy engine's chunked
            # head: each chunk's logits through the rounding
            rounded_head = variant_linear(base, tokens.vocab_size, lambda x, w: x @ w.T)
            VocabHead.logits = staticmethod(lambda h, w_c, out, f=rounded_head: np.copyto(out, f(h, w_c)))
        if base.endswith((":dh-rn", ":dh-sr")):
            VocabHead.weighted_rows = staticmethod(dh_product(base[-2:]))
        t0 = time.perf_counter()
        try:
            if args.train:  # the train stage's key has no variant: its checkpoints are deleted and trained afresh
                shutil.rmtree(stages.train.checkpoint_root(cfg, student, tokens, teacher), ignore_errors=True)
                trained = stages.train.run(cfg, student, tokens, teacher)[-1]
                if args.eval_exact:
                    reference.linear_forward, VocabHead.logits = exact, exact_logits
                    reference.lora_forward, reference.lora_backward = exact_lora
                m = evaluate(cfg, **where, checkpoint=trained.path_in(root))
            else:
                m = evaluate(cfg, **where, checkpoint=None)
        finally:
            reference.linear_forward, VocabHead.logits, VocabHead.weighted_rows = exact, exact_logits, exact_sum
            reference.lora_forward, reference.lora_backward = exact_lora
            reference.project_backward = exact_back
        first = first if first is not None else float(m["kl"])
        row = {k: m.get(k) for k in ("kl", "top1", "ce")} | ({"evaluated": "exact"} if args.eval_exact else {})
        print(json.dumps({"variant": name, **row, "kl_vs_first": round(float(m["kl"]) / first - 1, 4),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
