// LoRA term of the integer GEMM's epilogue (include of matmul_i8.wgsl, its LoRA variant): T = x A^T [M, r] and
// LB = B [N, r], both f32 rows of r / 4 vec4 (r a multiple of 4); each written value gets s * T[m, :] . LB[n, :].
@group(0) @binding(6) var<storage, read> T: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> LB: array<vec4<f32>>;

// s * T[row] . LB[n] for this invocation's rows m, m + 2, ..., m + 14 (clamped) of column n (< N)
fn lora8(m: u32, n: u32) -> array<f32, 8> {
    var s: array<f32, 8>;
    for (var q = 0u; q < prm.lr4; q++) {
        let b = LB[n * prm.lr4 + q];
        for (var e = 0u; e < 8u; e++) {
            s[e] += dot(T[min(m + 2u * e, prm.M - 1u) * prm.lr4 + q], b);
        }
    }
    for (var e = 0u; e < 8u; e++) {
        s[e] *= prm.ls;
    }
    return s;
}
