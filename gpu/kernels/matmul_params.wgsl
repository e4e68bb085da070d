// Uniform block shared by the matmul kernels (matmul_f32.wgsl, matmul_tc.wgsl); filled by
// gpu/ops/matmul.py's GemmShape.params().
//   C[M, P] (+)= alpha * A[M, R] . B[R, P], B read from a weight W of shape [N, K].
struct Params {
    M: u32,
    P: u32,
    R: u32,
    K: u32,      // weight row length
    lda: u32,
    ldc: u32,
    a_off: u32,
    c_off: u32,
    alpha: f32,
    N: u32,      // weight rows
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
