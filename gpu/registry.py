"""Every (kernel, variant) the model can dispatch, and the one way the ops build an op kernel's pipeline.

An op kernel is gpu/kernels/<part>.wgsl files joined in order: shared skeletons and includes (threads, elementwise,
rows, workgroup_reduce, workgroup_sum, logsumexp, attention_common, ...) and the op's own body, with ${NAME}
placeholders filled from its variant. KERNELS lists each op kernel with its parts and the values its variant
parameters may take (as llama.cpp's vulkan-shaders-gen lists each shader with its defines); `pipeline(dev, name,
**variant)` refuses a variant outside them, so everything the ops dispatch is in `entries()`, which
tests/test_kernel_registry.py compiles. The matmul kernels come from their generators: every weight type x
orientation x tile preset x store mode of gpu/codegen.py, and every tensor-core variant of the presets
gpu/ops/matmul_tc.py picks from (its all_variants()).

Add an op kernel: write gpu/kernels/<name>.wgsl (a body after a skeleton, or a whole kernel), list it here with
its variant parameters, and call `pipeline(dev, "<name>", **variant)` from its op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gpu import codegen_attention_tc as attention_tc
from gpu.codegen import WEIGHT_TYPES, MatmulVariant, decode_snippet, fill, kernel_text, matmul_source, t16_values
from gpu.codegen_i8 import matmul_i8_source
from gpu.codegen_lora import LORA_GEMM_BK, STREAM_UNROLLS, lora_gemm_values, lora_rows_values, lora_stream_values
from gpu.codegen_lora_fused import RANK_BUCKETS, lora_fused_values
from gpu.codegen_lora_i8 import NBS, lora_sum_i8_values, lora_thin_i8_finish_values, lora_thin_i8_values
from gpu.codegen_tc import matmul_tc_source, weight_loader
from gpu.device import Device
from gpu.ops.matmul import CPU_TILE, CPU_TILE_SMALL_M, GPU_TILE, GPU_TILE_SMALL_M
from gpu.ops.matmul_i8 import all_i8_variants
from gpu.ops.matmul_tc import TC_TILE, TC_TILE_NARROW, TC_TILE_SMALL_M, all_variants
from model.int8 import GLU_BACK_WORKGROUPS, NORM_TURNED_MAX, ROTATIONS, ROW_WORKGROUPS
from model.kd import KINDS

BOOLS = (False, True)
# Attention: query rows (one thread each) per workgroup, and the head dims of the supported model families
# (Llama, Qwen, Mistral, SmolLM2: 64/128; Phi: 80/96; Gemma: 256) plus the small test models.
ATTENTION_ROWS = 64
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 128, 256)
# Top-k: (key, id) pairs sorted per workgroup (powers of two); 2048 pairs take 16 KiB of workgroup memory.
TOPK_SORT_SIZES = tuple(2**e for e in range(1, 12))
# KD head: where the teacher's tail mass comes from (kd_row.wgsl TAIL): not used, 1 - sum exp(lt), a buffer.
KD_TAILS = ("none", "derived", "given")
# The f32 matmul tile presets gemm() picks from (gpu/ops/matmul.py pick_tile), the tensor-core presets gemm_tc()
# picks from (gpu/ops/matmul_tc.py pick_config).
MATMUL_TILES = (GPU_TILE, GPU_TILE_SMALL_M, CPU_TILE, CPU_TILE_SMALL_M)
TC_TILES = (TC_TILE, TC_TILE_NARROW, TC_TILE_SMALL_M)


def attention_key_tile(head_dim: int) -> int:
    """Keys (or queries) staged per tile: two BK x D f32 tiles stay within 16 KiB of workgroup memory."""
    return 32 if head_dim <= 64 else 16 if head_dim <= 128 else 8


def _attention_values(head_dim: int) -> dict[str, int]:
    bk = attention_key_tile(head_dim)
    return {
        "D": head_dim,
        "DV": head_dim // 4,
        "BQ": ATTENTION_ROWS,
        "BK": bk,
        "BKD": bk * head_dim,
        "BKDV": bk * head_dim // 4,
    }


def _embedding_values(wtype: str) -> dict[str, str]:
    """A kernel reading a weight of type wtype through its decode snippet (embedding, weight_i8)."""
    return {"DECODE": decode_snippet(wtype), "W_ELEM": WEIGHT_TYPES[wtype].w_elem}


def _kd_finish_values(wtype: str, ce: bool) -> dict[str, object]:
    """kd_finish reads the LM head's rows at the teacher ids through its type's decode snippet."""
    return {**_embedding_values(wtype), "CE": ce}


def _weight_f16_values(wtype: str) -> dict[str, str]:
    """weight_f16 reads W through the tensor-core GEMM's loader of its type (gpu/codegen_tc.py weight_loader)."""
    w_elem, decode = weight_loader(wtype)
    return {"W_ELEM": w_elem, "DECODE": decode}


def _subgroups(tint: bool) -> dict[str, str]:
    """subgroups_directive.wgsl: Tint (Dawn) wants `enable subgroups;`, naga (wgpu-native) refuses it."""
    return {"ENABLE_SUBGROUPS": "enable subgroups;" if tint else ""}


def _quantize_i8_values(
    scaled: bool, vec4: bool, rot: int, tint: bool, wg: int, units: bool = False, table: bool = False
) -> dict[str, object]:
    """quantize_i8 with (scaled) or without a column scale multiplying X, reading X (and CS) by vec4 or by f32,
    rotated in blocks of rot (hadamard.wgsl; 0: not), for Tint or naga, wg invocations a row; units: a rotated
    chunk held as units of 16 (int8_units.wgsl; vec4); table: each row's X, Q and S offsets from Rows (one chunk a
    row, units, not scaled)."""
    elem = "vec4<f32>" if vec4 else "f32"
    binding = f"@group(0) @binding(4) var<storage, read> CS: array<{elem}>;"
    if vec4:
        group = "    return X[x0 / 4u + w]" + (" * CS[k0 / 4u + w]" if scaled else "") + ";"
    else:
        scale = " * vec4<f32>(CS[k], CS[k + 1u], CS[k + 2u], CS[k + 3u])" if scaled else ""
        group = (
            "    let i = x0 + 4u * w;\n    let k = k0 + 4u * w;\n"
            f"    return vec4<f32>(X[i], X[i + 1u], X[i + 2u], X[i + 3u]){scale};"
        )
    values = {"CS_BINDING": binding if scaled else "", "X_ELEM": elem, "GROUP4": group, "ROT": rot, "WG": wg}
    q0 = "(r * prm.k + c * prm.chunk)"
    values |= {"ROW_X0": "prm.x_off + r * prm.ldx + c * prm.chunk", "ROW_S": "r * prm.chunks + c", "TABLE_BINDING": ""}
    if table:
        values |= {
            "ROW_X0": "Rows[r].x",
            "ROW_S": "Rows[r].z",
            "TABLE_BINDING": "@group(0) @binding(4) var<storage, read> Rows: array<vec4<u32>>;",
        }
    if units:
        values |= {
            "Q_ELEM": "vec4<u32>",
            "UNIT_VALUES": "fn unit_values(u: u32) -> array<vec4<f32>, 4> {\n"
            "    return array<vec4<f32>, 4>(group4(4u * u), group4(4u * u + 1u), group4(4u * u + 2u), "
            "group4(4u * u + 3u));\n}",
            "CODES": f"rotated_unit_codes(lid, prm.chunk / 16u, {'Rows[r].y' if table else q0 + ' / 16u'}, k0)",
        }
    else:
        values |= {"Q_ELEM": "u32", "UNIT_VALUES": "", "CODES": f"codes_of_row(lid, prm.chunk / 4u, {q0} / 4u, k0)"}
    return values | _subgroups(tint)


def _weight_i8_values(wtype: str, rot: int, tint: bool, fixed: bool) -> dict[str, object]:
    return {**_embedding_values(wtype), "ROT": rot, "FIXED": fixed, **_subgroups(tint)}


def _weight_q4_k_values(rot: int, tint: bool, wg: int, fixed: bool) -> dict[str, object]:
    return {"ROT": rot, "WG": wg, "FIXED": fixed, **_subgroups(tint)}


def _hadamard_rows_values(rot: int, mode: str, tint: bool) -> dict[str, object]:
    """hadamard_rows: X R^T in place ("back"), Y += X R^T ("back_add"), Y = X R^T ("back_to"), or Y = X R
    ("forward")."""
    if mode == "back":
        bindings = "@group(0) @binding(1) var<storage, read_write> X: array<vec4<f32>>;"
        store = "X[base + w] = y;"
    else:
        bindings = (
            "@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;\n"
            "@group(0) @binding(2) var<storage, read_write> Y: array<vec4<f32>>;"
        )
        store = "Y[base + w] += y;" if mode == "back_add" else "Y[base + w] = y;"
    back = "false" if mode == "forward" else "true"
    return {"ROT": rot, "BINDINGS": bindings, "STORE": store, "BACK": back, **_subgroups(tint)}


def _lora_sum_finish_values(cols: bool) -> dict[str, str]:
    """lora_sum_i8_finish: rows (dB: C [D, N] over RF, the rows' divisors) or cols (dA, before its rotation back: C
    [N, D])."""
    c = "@group(0) @binding(3) var<storage, read_write> C: array<f32>;"
    if cols:
        return {
            "OUTPUT_NOTE": "Variant cols: factor s into row n % cols of output block j = n / cols, [cols, D] row-major"
            " at float offs[j] of C (dA's rows: one block an adapter).",
            "BINDINGS": c,
            "OUTPUT": "    let at = prm.offs[n / prm.cols] + (n % prm.cols) * (prm.count / prm.N) + e / prm.N;\n"
            "    var v = prm.factor * s;",
        }
    return {
        "OUTPUT_NOTE": "Variant rows: factor / RF[i] s into C[c_off + i N + n] (C [D, N] row-major), 0 where RF[i]"
        " is 0 (dB: RF the weight row scales sW that dY's codes carry).",
        "BINDINGS": "@group(0) @binding(3) var<storage, read> RF: array<f32>;\n" + c.replace("(3)", "(4)"),
        "OUTPUT": "    let at = prm.c_off + e;\n    let rf = RF[prm.rf_off + e / prm.N];\n"
        "    var v = select(0.0, prm.factor / rf, rf > 0.0) * s;",
    }


def _kd_row_values(kind: str, tail: str, ce: bool) -> dict[str, object]:
    return {"KIND": KINDS.index(kind), "TAIL": KD_TAILS.index(tail), "CE": ce}


def _half_output(half: bool, binding: int, index: str) -> dict[str, str]:
    """Template values of a kernel whose variant `half` also stores its f32 result y as f16 to Y16[index]."""
    if not half:
        return {"ENABLE_F16": "", "Y16_BINDING": "", "Y16_STORE": ""}
    return {
        "ENABLE_F16": "enable f16;",
        "Y16_BINDING": f"@group(0) @binding({binding}) var<storage, read_write> Y16: array<f16>;",
        "Y16_STORE": f"Y16[{index}] = f16(y);",
    }


def _lora_reduce_values(half: bool) -> dict[str, str]:
    """lora_reduce.wgsl: variant half also stores each result times h_factor as f16 (T16, gpu/ops/lora_matmul.py
    HalfCopy)."""
    return t16_values(half, 3, "T16[prm.h_off + prm.h_go[g] + (e / prm.N) * prm.h_ld + col] = f16(r * prm.h_factor);")


def _half_grads(half: bool) -> dict[str, str]:
    """Template values of the gated units' backward: variant half also stores dG and dU as f16 (DG16, DU16)."""
    if not half:
        return {"ENABLE_F16": "", "HALF_BINDINGS": "", "HALF_STORES": ""}
    return {
        "ENABLE_F16": "enable f16;",
        "HALF_BINDINGS": "@group(0) @binding(5) var<storage, read_write> DG16: array<f16>;\n"
        "@group(0) @binding(6) var<storage, read_write> DU16: array<f16>;",
        "HALF_STORES": "DG16[i] = f16(dg);\n    DU16[i] = f16(du);",
    }


_GLU_GATES = {"swiglu": "g * sigmoid(g)", "geglu": "gelu_tanh(g).x"}  # act(g) of the gated units, as WGSL
# (dG, dU) of the gated units from one element's dy, g, u, as swiglu_backward.wgsl / geglu_backward.wgsl compute them
_GLU_GRADS = {
    "swiglu": """    let sig = sigmoid(g);
    return vec2<f32>(dy * u * sig * (1.0 + g * (1.0 - sig)), dy * g * sig);""",
    "geglu": """    let f = gelu_tanh(g);
    return vec2<f32>(dy * u * f.y, dy * f.x);""",
}


def _glu_values(gate: str, half: bool) -> dict[str, str]:
    """Template values of glu_forward.wgsl: the activation `gate` of g (WGSL), and the variant's f16 copy."""
    return {"GATE": gate, **_half_output(half, 4, "i")}


def _literal(value: object) -> str:
    """A template value as WGSL source (bools as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Kernel:
    """An op kernel: its parts (gpu/kernels/<part>.wgsl, joined in order) and, per variant parameter, the values
    the model can dispatch. `values` maps a variant to the ${NAME} template values; without it parameter `x`
    fills ${X}."""

    parts: tuple[str, ...]
    params: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    values: Callable[..., Mapping[str, object]] | None = None

    def variants(self) -> list[dict[str, Any]]:
        """Every variant: the product of the parameters' values."""
        names = list(self.params)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*self.params.values())]

    def source(self, **variant: Any) -> str:
        """The kernel's WGSL for one variant."""
        values = self.values(**variant) if self.values else {k.upper(): v for k, v in variant.items()}
        text = "\n".join(kernel_text(f"{part}.wgsl") for part in self.parts)
        return fill(text, **{k: _literal(v) for k, v in values.items()})


_SUM = ("workgroup_reduce", "workgroup_sum")  # fixed-tree workgroup sums
_LSE = ("workgroup_reduce", "logsumexp")  # fixed-tree workgroup logsumexp states
_ROWS = ("rows",)  # one workgroup per row
_ITEMS = ("threads",)  # one thread per item
_ELEMENTWISE = (*_ITEMS, "elementwise", "sigmoid")
_ATTENTION = ("attention_common", "attention_kv_tile")
_HEAD_DIM = {"head_dim": HEAD_DIMS}
_I8_PARTS = ("int8_pack", "hadamard", "int8_codes")  # int8 codes of a row
_I8_UNITS = ("int8_pack", "hadamard", "int8_units", "int8_unit_rows")  # int8 codes of a rotated row as units of 16
_I8 = ("subgroups_directive", "workgroup_reduce", "absmax_combine", *_I8_PARTS)
_ROT = {"rot": ROTATIONS, "tint": BOOLS}  # the rotation's block, and the compiler (gpu/ops/quantize_i8.py)

KERNELS: dict[str, Kernel] = {
    # elementwise skeleton + body
    "add": Kernel((*_ELEMENTWISE, "add")),
    "add_inplace": Kernel((*_ELEMENTWISE, "add_inplace")),
    "add_unscaled": Kernel((*_ELEMENTWISE, "add_unscaled", "grad_scale"), {"acc": BOOLS}),
    "add_bias": Kernel((*_ELEMENTWISE, "add_bias")),
    "to_bf16": Kernel((*_ELEMENTWISE, "to_bf16")),
    "from_bf16": Kernel((*_ELEMENTWISE, "from_bf16")),
    "scale": Kernel((*_ELEMENTWISE, "scale")),
    "lora_group_sum": Kernel((*_ELEMENTWISE, "lora_group_sum"), {"acc": BOOLS}),
    "lora_pack": Kernel(("lora_pack", *_ITEMS)),
    # a weight's rows decoded to f16 as the tensor-core GEMM stages them (gpu/ops/half.py weight_to_f16)
    "weight_f16": Kernel(("weight_f16", *_ITEMS), {"wtype": tuple(WEIGHT_TYPES)}, _weight_f16_values),
    "swiglu_forward": Kernel(
        ("glu_forward", *_ELEMENTWISE), {"half": BOOLS}, partial(_glu_values, _GLU_GATES["swiglu"])
    ),
    "swiglu_backward": Kernel(
        ("glu_backward_io", "swiglu_backward", *_ELEMENTWISE), {"half": BOOLS}, lambda half: _half_grads(half)
    ),
    "geglu_forward": Kernel(
        ("glu_forward", *_ELEMENTWISE, "gelu_tanh"), {"half": BOOLS}, partial(_glu_values, _GLU_GATES["geglu"])
    ),
    "geglu_backward": Kernel(
        ("glu_backward_io", "geglu_backward", *_ELEMENTWISE, "gelu_tanh"),
        {"half": BOOLS},
        lambda half: _half_grads(half),
    ),
    "adamw_update": Kernel((*_ELEMENTWISE, "adamw_update")),
    # row skeleton (one workgroup per row) + body
    "rmsnorm_forward": Kernel(
        ("rmsnorm_forward", "rmsnorm_io", *_ROWS, *_SUM),
        {"half": BOOLS},
        lambda half: {**_half_output(half, 4, "base + i"), "IO_ELEM": "f32"},
    ),
    "rmsnorm_backward": Kernel((*_ROWS, *_SUM, "rmsnorm_backward_io", "rmsnorm_backward"), {}, lambda: {"ELEM": "f32"}),
    # rows of a multiple of 4 read as vec4s, once (gpu/ops/rmsnorm.py VEC4_BACKWARD)
    "rmsnorm_backward4": Kernel(
        (*_ROWS, *_SUM, "rmsnorm_backward_io", "rmsnorm_backward4"), {}, lambda: {"ELEM": "vec4<f32>"}
    ),
    # a gated unit's forward and the int8 codes of its output in one pass (gpu/ops/quantize_i8.py glu_i8)
    "glu_i8": Kernel(
        ("subgroups_directive", "workgroup_reduce", "absmax_combine", *_I8_PARTS, "sigmoid", "gelu_tanh", "glu_i8")
        + ("rows_rotated",),
        {"act": ("swiglu", "geglu"), **_ROT, "wg": ROW_WORKGROUPS},
        lambda act, rot, tint, wg: {"GATE": _GLU_GATES[act], "ROT": rot, "WG": wg, **_subgroups(tint)},
    ),
    # the same for rotated rows held as units of 16 (rows of at most 64 x wg)
    "glu_i8_units": Kernel(
        ("subgroups_directive", "workgroup_reduce", "absmax_combine", *_I8_UNITS, "sigmoid", "gelu_tanh")
        + ("int8_unit_store", "glu_i8_units", "rows_rotated"),
        {"act": ("swiglu", "geglu"), "rot": ROTATIONS[1:], "tint": BOOLS, "wg": ROW_WORKGROUPS},
        lambda act, rot, tint, wg: {"GATE": _GLU_GATES[act], "ROT": rot, "WG": wg, **_subgroups(tint)},
    ),
    # a gated unit's backward and the int8 codes of both its gradients (gpu/ops/quantize_i8.py glu_backward_i8)
    "glu_back_i8": Kernel(
        ("subgroups_directive", "workgroup_reduce", "int8_pack", "hadamard", "sigmoid", "gelu_tanh", "glu_back_i8")
        + ("rows_rotated",),
        {"act": ("swiglu", "geglu"), **_ROT, "wg": GLU_BACK_WORKGROUPS},
        lambda act, rot, tint, wg: {"GRADS": _GLU_GRADS[act], "ROT": rot, "WG": wg, **_subgroups(tint)},
    ),
    # RMSNorm forward and the int8 codes of its output in one pass (gpu/ops/quantize_i8.py rmsnorm_i8)
    "rmsnorm_i8": Kernel(
        ("subgroups_directive", "workgroup_reduce", *_I8_PARTS, "rmsnorm_io", "rmsnorm_pairs", "rmsnorm_i8")
        + ("rows_rotated",),
        {"rot": ROTATIONS, "tint": BOOLS},
        lambda rot, tint: {"ROT": rot, "IO_ELEM": "f32", **_subgroups(tint)},
    ),
    # the same for rotated rows held as units of 16 (rows of a multiple of 16, at most 4096)
    "rmsnorm_i8_units": Kernel(
        ("subgroups_directive", "workgroup_reduce", *_I8_UNITS, "int8_unit_store", "rmsnorm_io", "rmsnorm_pairs")
        + ("rmsnorm_i8_units", "rows_rotated"),
        {"rot": ROTATIONS[1:], "tint": BOOLS},
        lambda rot, tint: {"ROT": rot, "IO_ELEM": "vec4<f32>", **_subgroups(tint)},
    ),
    # RMSNorm backward (+ a residual) and the int8 codes of its result times a projection's row scales in one pass
    # (gpu/ops/quantize_i8.py rmsnorm_backward_i8); rot: dY arrives rotated in blocks of rot, turned back first
    "rmsnorm_back_i8": Kernel(
        ("subgroups_directive", "workgroup_reduce", *_I8_PARTS, "rmsnorm_back_i8", "rows_rotated"),
        {"rot": ROTATIONS, "tint": BOOLS},
        lambda rot, tint: {"ROT": rot, "DYR": NORM_TURNED_MAX if rot else 1, **_subgroups(tint)},
    ),
    "kd_stats": Kernel((*_ROWS, *_LSE, "kd_stats_plain", "kd_stats")),
    # the one-pass backward (gpu/ops/kd.py): pass 1 also emits each chunk's probabilities (in place, or f16)
    "kd_stats_probs": Kernel((*_ROWS, *_LSE, "kd_probs_f32", "kd_stats")),
    "kd_stats_probs16": Kernel((*_ROWS, *_LSE, "kd_probs_f16", "kd_stats")),
    "kd_stats_probs8": Kernel((*_ROWS, *_LSE, "kd_probs_i8", "kd_stats")),
    "kd_rescaled_add": Kernel((*_ELEMENTWISE, "kd_rescaled_add"), {"acc": BOOLS}),
    "kd_finish": Kernel(("kd_finish", "row_vec4"), {"wtype": tuple(WEIGHT_TYPES), "ce": BOOLS}, _kd_finish_values),
    "kd_grad": Kernel((*_ROWS, "kd_grad"), {"ce": BOOLS}),
    "topk": Kernel((*_ROWS, *_LSE, "topk"), {"ns": TOPK_SORT_SIZES}),
    # the sampled store's two passes over the vocabulary (gpu/ops/sampled.py)
    "sample_stats": Kernel((*_ROWS, "workgroup_reduce", "sample_piece", "sample_stats")),
    "sample_draw": Kernel((*_ROWS, "workgroup_reduce", "sample_piece", "sample_draw")),
    # other workgroup reductions
    "reduce_sum": Kernel((*_SUM, "reduce_sum", "reduce_term_value")),
    "absmax": Kernel(("workgroup_reduce", "absmax")),
    "quantize_i8": Kernel(
        (*_I8, "quantize_i8"), {"scaled": BOOLS, "vec4": BOOLS, **_ROT, "wg": ROW_WORKGROUPS}, _quantize_i8_values
    ),
    "quantize_i8_units": Kernel(
        ("subgroups_directive", "workgroup_reduce", "absmax_combine", *_I8_UNITS, "quantize_i8"),
        {"scaled": BOOLS, "rot": ROTATIONS[1:], "tint": BOOLS, "wg": ROW_WORKGROUPS},
        partial(_quantize_i8_values, vec4=True, units=True),
    ),
    # rows gathered by a table (LoRA's A codes, gpu/ops/lora_i8.py LoraCodes)
    "quantize_i8_table": Kernel(
        ("subgroups_directive", "workgroup_reduce", "absmax_combine", *_I8_UNITS, "quantize_i8"),
        {"rot": ROTATIONS[1:], "tint": BOOLS, "wg": ROW_WORKGROUPS},
        partial(_quantize_i8_values, scaled=False, vec4=True, units=True, table=True),
    ),
    # weight_i8*: fixed, the rows' scales given (kept from an earlier decode: gpu/model.py row scales)
    "weight_i8": Kernel((*_I8, "weight_i8"), {"wtype": tuple(WEIGHT_TYPES), **_ROT, "fixed": BOOLS}, _weight_i8_values),
    "hadamard_rows": Kernel(
        ("subgroups_directive", "hadamard", "hadamard_rows", "rows_rotated"),
        {"rot": ROTATIONS[1:], "mode": ("back", "back_add", "back_to", "forward"), "tint": BOOLS},
        _hadamard_rows_values,
    ),
    # f16 mirrors of the LoRA parameters, A rotated like the weight codes (gpu/ops/lora_mirror.py)
    "lora_mirror": Kernel(
        ("subgroups_directive", "lora_mirror", "hadamard", "rows_rotated"),
        {"rot": ROTATIONS[1:], "tint": BOOLS},
        lambda rot, tint: {"ROT": rot, **_subgroups(tint)},
    ),
    "weight_i8_q4_k": Kernel(
        ("subgroups_directive", "workgroup_reduce", "absmax_combine", "int8_pack", "hadamard", "int8_units")
        + ("weight_i8_q4_k",),
        {**_ROT, "wg": ROW_WORKGROUPS, "fixed": BOOLS},
        _weight_q4_k_values,
    ),
    "transpose_i8": Kernel(("transpose_i8",)),
    "count_nonzero": Kernel((*_SUM, "reduce_sum", "reduce_term_nonzero")),
    "grad_norm_partial": Kernel((*_SUM, "grad_norm_partial")),
    "adamw_finalize": Kernel((*_SUM, "adamw_finalize")),
    # one thread per row / item
    "kd_row": Kernel((*_ITEMS, "kd_row"), {"kind": KINDS, "tail": KD_TAILS, "ce": BOOLS}, _kd_row_values),
    "topk_finish": Kernel((*_ITEMS, "topk_finish")),
    "sample_thresholds": Kernel((*_ITEMS, "philox", "sample_thresholds")),
    "sample_encode": Kernel((*_ITEMS, "sample_encode")),
    "philox_words": Kernel((*_ITEMS, "philox", "philox_words")),
    "embedding": Kernel(("embedding", "row_vec4"), {"wtype": tuple(WEIGHT_TYPES)}, _embedding_values),
    "rope": Kernel(("rope", "rope_position_offset"), {"neox": BOOLS}),
    "rope_positions": Kernel(("rope", "rope_position_buffer"), {"neox": BOOLS}),
    # tiled
    "attention_forward": Kernel((*_ATTENTION, "attention_forward"), _HEAD_DIM, _attention_values),
    "attention_backward_dq": Kernel((*_ATTENTION, "attention_backward_dq"), _HEAD_DIM, _attention_values),
    "attention_backward_dkv": Kernel(("attention_common", "attention_backward_dkv"), _HEAD_DIM, _attention_values),
    "strided_matmul": Kernel(("strided_matmul",)),
    # LoRA products (gpu/ops/lora_matmul.py): output tiles 16 wide (x A^T, dy B, dB, dA^T) or 64 (t B^T, dt A)
    "lora_gemm": Kernel(("lora_gemm",), {"bn": tuple(LORA_GEMM_BK)}, lora_gemm_values),
    "lora_reduce": Kernel(("lora_reduce", *_ITEMS), {"half": BOOLS}, _lora_reduce_values),
    # LoRA's t = x A^T from the projection's int8 operand (gpu/ops/lora_i8.py; tint: on the integer subgroup
    # matrices, else emulated), and its pass adding the chunks and applying the scales
    "lora_thin_i8": Kernel(("lora_thin_i8", "lora_i8_steps"), {"nb": NBS, "tint": BOOLS}, lora_thin_i8_values),
    "lora_thin_i8_finish": Kernel(("lora_thin_i8_finish", *_ITEMS), {"half": BOOLS}, lora_thin_i8_finish_values),
    # the codes of B / sW for dt = s dY B on it (gpu/ops/lora_i8.py LoraGradCodes)
    "lora_b_codes": Kernel(("workgroup_reduce", "absmax_combine", "int8_pack", "lora_b_codes")),
    # dB = s dY^T t from dY's int8 codes (gpu/ops/lora_db_i8.py): t times dY's row scales rounded per column and
    # chunk of rows, the chunks' sums (tint: on the integer subgroup matrices, else emulated), the pass adding them
    "lora_cols_i8": Kernel(("workgroup_reduce", "absmax_combine", "int8_pack", "lora_cols_i8")),
    "lora_sum_i8": Kernel(("lora_sum_i8", "lora_i8_steps"), {"nb": NBS, "tint": BOOLS}, lora_sum_i8_values),
    "lora_sum_i8_finish": Kernel(("lora_sum_i8_finish", *_ITEMS), {"cols": BOOLS}, _lora_sum_finish_values),
    # the bandwidth paths of the thin products (gpu/ops/lora_matmul.py): over the large operand's rows (dB, dA^T), or
    # along them (t, dt; S read k-fast: A's rows)
    "lora_stream": Kernel(("lora_paths_common", "lora_stream"), {"unroll": STREAM_UNROLLS}, lora_stream_values),
    "lora_rows": Kernel(("lora_paths_common", "lora_rows"), {"s_kfast": BOOLS}, lora_rows_values),
    # LoRA backward's dB and dt in one pass over dY (gpu/ops/lora_dual.py)
    "lora_dual": Kernel(("lora_dual",), {"cr": (256,)}),
    # a LoRA reduction + expansion pair in one dispatch (gpu/ops/lora_fused.py), per rank bucket r <= rb
    "lora_fused": Kernel(("lora_fused",), {"rb": RANK_BUCKETS}, lora_fused_values),
}


@dataclass(frozen=True)
class GeneratedKernel:
    """An op kernel whose WGSL a generator builds from its variant (same interface as Kernel)."""

    generate: Callable[..., str]
    params: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def variants(self) -> list[dict[str, Any]]:
        names = list(self.params)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*self.params.values())]

    def source(self, **variant: Any) -> str:
        return self.generate(**variant)


_TC_HEAD_DIM = {"head_dim": attention_tc.ATTENTION_TC_HEAD_DIMS}
# ... and whether a subgroup skips the products of its causally masked blocks (gpu/ops/attention_tc.py SKIP_MASKED)
_TC_SKIPPING = _TC_HEAD_DIM | {"skip_masked": BOOLS}
# ... the forward's: and where its subgroups exchange the reference max's flags (gpu/ops/attention_tc.py ONE_FLAG)
_TC_FORWARD = _TC_SKIPPING | {"one_flag": BOOLS}
# Tensor-core op kernels (Dawn only: subgroup matrices / subgroups): gpu/ops/attention_tc.py, gpu/ops/half.py.
TC_KERNELS: dict[str, GeneratedKernel] = {
    "pack_f16": GeneratedKernel(attention_tc.pack_source, {"scaled": BOOLS}),
    "pack_f16_rope": GeneratedKernel(attention_tc.pack_rope_source, {"neox": BOOLS}),
    "attention_tc_delta": GeneratedKernel(attention_tc.delta_source, _TC_HEAD_DIM),
    "attention_tc_forward": GeneratedKernel(attention_tc.forward_source, _TC_FORWARD),
    # 8 subgroups (128 query rows) sharing each staged key tile (attention_tc.py FORWARD_SUBGROUPS)
    "attention_tc_forward8": GeneratedKernel(
        partial(attention_tc.forward_source, subgroups=attention_tc.WIDE_FORWARD_SUBGROUPS), _TC_FORWARD
    ),
    "attention_tc_backward_dq": GeneratedKernel(attention_tc.backward_dq_source, _TC_HEAD_DIM),
    "attention_tc_backward_dkv": GeneratedKernel(attention_tc.backward_dkv_source, _TC_HEAD_DIM),
    # S and dP side by side, 4 barriers a tile instead of 6 (gpu/ops/attention_tc.py PAIRED_BACKWARD)
    "attention_tc_backward_dq_paired": GeneratedKernel(
        partial(attention_tc.backward_dq_source, paired=True), {"head_dim": (128,)}
    ),
    "attention_tc_backward_dkv_paired": GeneratedKernel(
        partial(attention_tc.backward_dkv_source, paired=True), _TC_HEAD_DIM
    ),
    # dQ from the dS the dK/dV pass stores (gpu/ops/attention_tc.py DQ_FROM_DS)
    "attention_tc_backward_dkv_ds": GeneratedKernel(
        partial(attention_tc.backward_dkv_source, paired=True, store_ds=True), _TC_SKIPPING
    ),
    "attention_tc_backward_dqs": GeneratedKernel(attention_tc.backward_dqs_source, _TC_SKIPPING),
    "attention_tc_reduce": GeneratedKernel(attention_tc.reduce_source),
}


def kernel_key(name: str, variant: Mapping[str, Any]) -> tuple:
    """The pipeline-cache key of an op kernel variant."""
    return (name, tuple(sorted(variant.items())))


def _checked(name: str, variant: Mapping[str, Any]) -> Kernel | GeneratedKernel:
    """KERNELS[name] (or TC_KERNELS[name]), after checking that the variant is one it lists (errors name this
    file)."""
    kernel = KERNELS.get(name) or TC_KERNELS.get(name)
    if kernel is None:
        raise ValueError(f"no kernel {name!r} in gpu/registry.py KERNELS")
    if set(variant) != set(kernel.params):
        raise ValueError(f"kernel {name!r}: variant parameters {sorted(variant)}, expected {sorted(kernel.params)}")
    for param, value in variant.items():
        if value not in kernel.params[param]:
            allowed = kernel.params[param]
            raise ValueError(f"kernel {name!r} has no variant {param}={value!r}; gpu/registry.py lists {allowed}")
    return kernel


def kernel_source(name: str, **variant: Any) -> str:
    """The WGSL of an op kernel variant."""
    return _checked(name, variant).source(**variant)


def pipeline(dev: Device, name: str, **variant: Any) -> Any:
    """The cached compute pipeline of op kernel `name` in `variant` (one of the variants KERNELS lists)."""
    kernel = _checked(name, variant)
    return dev.pipeline(kernel_key(name, variant), lambda: kernel.source(**variant))


def matmul_variants() -> list[MatmulVariant]:
    """The f32 matmul variants gemm() dispatches: weight type x orientation x tile preset x store mode (the
    model never reads A transposed)."""
    return [
        MatmulVariant(wtype, orient, tile, trans_a=False, accumulate=accumulate)
        for wtype in WEIGHT_TYPES
        for orient in ("nt", "nn")
        for tile in MATMUL_TILES
        for accumulate in BOOLS
    ]


@dataclass(frozen=True)
class Entry:
    """One (kernel, variant): the key the ops pass to Device.pipeline, and its WGSL."""

    key: tuple
    source: Callable[[], str]
    compiler: str = "any"  # "tint": Dawn's only (subgroup matrices, or Tint's directives); "naga": wgpu-native's


def entries() -> list[Entry]:
    """Every (kernel, variant) the model can dispatch: op kernels, f32 matmuls and tensor-core matmuls."""
    out = [
        Entry(kernel_key(name, v), partial(kernel.source, **v), {True: "tint", False: "naga"}.get(v.get("tint"), "any"))
        for name, kernel in KERNELS.items()
        for v in kernel.variants()
    ]
    out += [Entry(v.key, partial(matmul_source, v)) for v in matmul_variants()]
    tc = {v for cfg in TC_TILES for v in all_variants(cfg, list(WEIGHT_TYPES))}
    out += [Entry((*v.key, False), partial(matmul_tc_source, v), "tint") for v in sorted(tc, key=str)]
    out += [Entry((*v.key, False), partial(matmul_i8_source, v), "tint") for v in all_i8_variants()]
    out += [
        Entry(kernel_key(name, v), partial(kernel.source, **v), "tint")
        for name, kernel in TC_KERNELS.items()
        for v in kernel.variants()
    ]
    return out
