"""Template values of lora_thin_i8.wgsl (gpu/ops/lora_i8.py): its products on the integer subgroup matrices, or
the same sums in plain WGSL (`tint` False: adapters without them, e.g. lavapipe in the tests)."""

from __future__ import annotations

from collections.abc import Callable

from gpu.codegen import t16_values

MMA_K = 32  # codes per integer MMA (16 x 16 x 32)
STEP_CODES = 64  # lora_thin_i8.wgsl's BK
NBS = tuple(range(1, 9))  # 16-column blocks a variant covers (N = 16 nb)

_TC_DIRECTIVES = "\n".join(
    (
        "diagnostic(off, chromium.subgroup_matrix_uniformity);",
        "enable subgroups;",
        "enable chromium_experimental_subgroup_matrix;",
    )
)
_LEFT = "subgroup_matrix_left<i8, 32, 16>"
_RIGHT = "subgroup_matrix_right<i8, 16, 32>"

_EMU_HELPERS = """
// code b (0..3, little-endian) of a word of four int8 codes, sign-extended
fn code(w: i32, b: u32) -> i32 {
    return (w << (24u - 8u * b)) >> 24u;
}"""

_EMU_COMPUTE = """        for (var j = 0u; j < NB; j++) {
            for (var e = 0u; e < 8u; e++) {
                let q = e * 32u + lane;
                var s = 0;
                for (var w = 0u; w < BK / 4u; w++) {
                    let xw = S[sg][(q / 16u) * LDW + w];
                    let aw = S[4u + j][(q % 16u) * LDW + w];
                    for (var b = 0u; b < 4u; b++) {
                        s += code(xw, b) * code(aw, b);
                    }
                }
                acc[j * 8u + e] += s;
            }
        }"""

_EMU_STORE = """    for (var j = 0u; j < NB; j++) {
        for (var e = 0u; e < 8u; e++) {
            let q = e * 32u + lane;
            P[base + (q / 16u) * prm.N + j * 16u + q % 16u] = acc[j * 8u + e];
        }
    }"""


def _mma_steps(nb: int, left: Callable[[int], str], right: Callable[[int, int], str]) -> str:
    """A step's integer MMAs: per 32 codes k of the step, the subgroup's left matrix (left(k): its pointer, offset
    and column-major flag) times each column block j's right matrix (right(j, k): pointer and offset; column-major)
    into acc j."""
    lines, ind = [], " " * 12
    for k in range(0, STEP_CODES, MMA_K):
        lines += ["        {", f"{ind}let a = subgroupMatrixLoad<{_LEFT}>({left(k)}, LDW * 4u);"]
        for j in range(nb):
            lines.append(f"{ind}let b{j} = subgroupMatrixLoad<{_RIGHT}>({right(j, k)}, true, LDW * 4u);")
            lines.append(f"{ind}acc{j} = subgroupMatrixMultiplyAccumulate(a, b{j}, acc{j});")
        lines.append("        }")
    return "\n".join(lines)


def lora_thin_i8_values(nb: int, tint: bool) -> dict[str, str]:
    """lora_thin_i8.wgsl for `nb` column blocks, on the integer subgroup matrices (tint) or emulated."""
    if nb not in NBS:
        raise ValueError(f"lora_thin_i8: {nb} column blocks, expected one of {NBS}")
    common = {"NB": str(nb)}
    if not tint:
        return common | {
            "COMPUTE_NOTE": "This variant: the same sums in plain WGSL, lane q % 32 of the subgroup owning 8 of each "
            "block's values (row q / 16, column q % 16 for q = 32 e + lane).",
            "DIRECTIVES": "",
            "SG_PARAM": "",
            "SG_LET": "\n    let sg = lid / 32u;\n    let lane = lid % 32u;",
            "HELPERS": _EMU_HELPERS,
            "ACC_DECL": f"    var acc: array<i32, {8 * nb}>;",
            "COMPUTE": _EMU_COMPUTE,
            "STORE": _EMU_STORE,
        }
    compute = _mma_steps(nb, lambda k: f"&S[sg], {k}u, false", lambda j, k: f"&S[{4 + j}], {k}u")
    return common | {
        "COMPUTE_NOTE": "Results leave by subgroup-matrix stores straight to P.",
        "DIRECTIVES": _TC_DIRECTIVES,
        "SG_PARAM": "\n    @builtin(subgroup_id) sg: u32,",
        "SG_LET": "",
        "HELPERS": "",
        "ACC_DECL": "\n".join(f"    var acc{j} = subgroup_matrix_result<i32, 16, 16>();" for j in range(nb)),
        "COMPUTE": compute,
        "STORE": "\n".join(f"    subgroupMatrixStore(&P, base + {16 * j}u, acc{j}, false, prm.N);" for j in range(nb)),
    }


_SUM_EMU_COMPUTE = """        for (var j = 0u; j < NB; j++) {
            for (var e = 0u; e < 8u; e++) {
                let q = e * 32u + lane;
                let i = sg * 16u + q / 16u;
                var s = 0;
                for (var m = 0u; m < BK; m++) {
                    let lw = SL[m * LDW + i / 4u];
                    let rw = SR[j][(q % 16u) * LDW + m / 4u];
                    s += code(lw, i % 4u) * code(rw, m % 4u);
                }
                acc[j * 8u + e] += s;
            }
        }"""


def lora_sum_i8_values(nb: int, tint: bool) -> dict[str, str]:
    """lora_sum_i8.wgsl for `nb` column blocks, on the integer subgroup matrices (tint) or emulated."""
    values = lora_thin_i8_values(nb, tint)
    if not tint:
        return values | {"COMPUTE": _SUM_EMU_COMPUTE}
    # L^T's 16 x 32 block: the subgroup's 16 columns of the step's 32 rows m, read column-major
    compute = _mma_steps(nb, lambda k: f"&SL, {k}u * LDW * 4u + sg * 16u, true", lambda j, k: f"&SR[{j}], {k}u")
    return values | {"COMPUTE": compute}


def lora_thin_i8_finish_values(half: bool) -> dict[str, str]:
    """lora_thin_i8_finish.wgsl: variant half also stores h_factor t as f16 (T16)."""
    return t16_values(half, 5, "T16[prm.h_go[g] + m * prm.r + c] = f16(t * prm.h_factor);")
