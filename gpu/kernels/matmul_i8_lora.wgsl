// LoRA term of the integer GEMM's epilogue (include of matmul_i8.wgsl, its LoRA variants): T [M, r] as rows of r / 4
// vec4 (r a multiple of 4) and L [r, N], stored as LB = L^T [N, r] ("rows": the forward's B) or as L itself
// ("cols": the input gradient's A; ${LB_LOAD} reads either); each written value gets s * T[m, :] . L[:, n].
@group(0) @binding(6) var<storage, read> T: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> LB: array<${LB_ELEM}>;

// s * T[row] . L[:, n] for this invocation's rows m, m + 2, ..., m + 14 (clamped) of column n (< N)
fn lora8(m: u32, n: u32) -> array<f32, 8> {
    var s: array<f32, 8>;
    for (var q = 0u; q < prm.lr4; q++) {
        let b = ${LB_LOAD};
        for (var e = 0u; e < 8u; e++) {
            s[e] += dot(T[min(m + 2u * e, prm.M - 1u) * prm.lr4 + q], b);
        }
    }
    for (var e = 0u; e < 8u; e++) {
        s[e] *= prm.ls;
    }
    return s;
}
