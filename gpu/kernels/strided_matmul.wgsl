// Small general f32 matmul with arbitrary strides (LoRA's skinny products, the KD head's chunk logits):
//   C[m, n] = alpha * sum_k A[a_off + m*sam + k*sak] * B[b_off + k*sbk + n*sbn]  (+ C[m, n] if accumulate)
// C row-major at c_off with row stride ldc. 16 x 16 output tile per workgroup (one output per thread),
// 16 reduction steps staged in workgroup memory; the k sum runs in ascending order: reproducible.

struct Params {
    M: u32,
    N: u32,
    K: u32,
    a_off: u32,
    sam: u32,
    sak: u32,
    b_off: u32,
    sbk: u32,
    sbn: u32,
    c_off: u32,
    ldc: u32,
    alpha: f32,
    accumulate: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const TS: u32 = 16u;
var<workgroup> As: array<f32, 256>;   // As[m * TS + k]
var<workgroup> Bs: array<f32, 256>;   // Bs[k * TS + n]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let m = wid.y * TS + l.y;
    let n = wid.x * TS + l.x;
    var acc = 0.0;
    for (var k0 = 0u; k0 < prm.K; k0 += TS) {
        let ka = k0 + l.x;
        var a = 0.0;
        if (m < prm.M && ka < prm.K) {
            a = A[prm.a_off + m * prm.sam + ka * prm.sak];
        }
        let kb = k0 + l.y;
        var b = 0.0;
        if (kb < prm.K && n < prm.N) {
            b = B[prm.b_off + kb * prm.sbk + n * prm.sbn];
        }
        As[l.y * TS + l.x] = a;
        Bs[l.y * TS + l.x] = b;
        workgroupBarrier();
        for (var kk = 0u; kk < TS; kk++) {
            acc = fma(As[l.y * TS + kk], Bs[kk * TS + l.x], acc);
        }
        workgroupBarrier();
    }
    if (m < prm.M && n < prm.N) {
        let c = prm.c_off + m * prm.ldc + n;
        var r = prm.alpha * acc;
        if (prm.accumulate != 0u) {
            r += C[c];
        }
        C[c] = r;
    }
}
