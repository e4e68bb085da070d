// LoRA's skinny f32 products (gpu/ops/lora_matmul.py), with arbitrary strides:
//   A(m, k) = A[a_off + m * sam + k * sak],  B(k, n) = B[b_off + k * sbk + n * sbn],
//   direct:  C[c_off + m * csm + n * csn] = alpha * sum_k A(m, k) B(k, n)  (+ that element if accumulate)
//   partial: C[z * M * N + m * N + n] = sum over k in [z * chunk, (z + 1) * chunk) (lora_reduce adds them up)
// The reduction axis is split over grid z (chunk per workgroup), so a long reduction (over T tokens, or over
// d) runs on many workgroups. BM x BN outputs per workgroup, 4 x 4 per thread (vec4 over n), BK steps staged
// in workgroup memory; each staged unit is 4 consecutive m (or n) at one k, loaded by threads walking the
// operand's contiguous axis (a_kfast / b_kfast) so the loads coalesce. Every sum runs in ascending k:
// reproducible, no atomics.

struct Params {
    M: u32,
    N: u32,
    K: u32,
    chunk: u32,
    a_off: u32,
    sam: u32,
    sak: u32,
    b_off: u32,
    sbk: u32,
    sbn: u32,
    c_off: u32,
    csm: u32,
    csn: u32,
    alpha: f32,
    accumulate: u32,
    partial: u32,
    a_kfast: u32,
    b_kfast: u32,
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const BM: u32 = 64u;
const BN: u32 = ${BN}u;
const BK: u32 = ${BK}u;
const TM: u32 = BM / 4u;   // threads along m (4 rows each)
const TN: u32 = BN / 4u;   // threads along n (4 columns each)
const THREADS: u32 = TM * TN;
var<workgroup> As: array<vec4<f32>, BK * TM>;   // As[k * TM + q] = A(m0 + 4q .. 4q + 3, k0 + k)
var<workgroup> Bs: array<vec4<f32>, BK * TN>;   // Bs[k * TN + q] = B(k0 + k, n0 + 4q .. 4q + 3)

fn a_at(m: u32, k: u32, k_end: u32) -> f32 {
    if (m < prm.M && k < k_end) {
        return A[prm.a_off + m * prm.sam + k * prm.sak];
    }
    return 0.0;
}

fn b_at(k: u32, n: u32, k_end: u32) -> f32 {
    if (n < prm.N && k < k_end) {
        return B[prm.b_off + k * prm.sbk + n * prm.sbn];
    }
    return 0.0;
}

fn store_row(m: u32, n0: u32, z: u32, v: vec4<f32>) {
    if (m >= prm.M) {
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        let n = n0 + c;
        if (n < prm.N) {
            if (prm.partial != 0u) {
                C[(z * prm.M + m) * prm.N + n] = v[c];
            } else {
                let i = prm.c_off + m * prm.csm + n * prm.csn;
                var r = prm.alpha * v[c];
                if (prm.accumulate != 0u) {
                    r += C[i];
                }
                C[i] = r;
            }
        }
    }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let m0 = wid.x * BM;
    let n0 = wid.y * BN;
    let z = wid.z;
    let k_begin = z * prm.chunk;
    let k_end = min(prm.K, k_begin + prm.chunk);
    let tm = l % TM;
    let tn = l / TM;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        for (var u = l; u < BK * TM; u += THREADS) {
            var k: u32;
            var q: u32;
            if (prm.a_kfast != 0u) {
                k = u % BK;
                q = u / BK;
            } else {
                q = u % TM;
                k = u / TM;
            }
            let m = m0 + 4u * q;
            let kk = k0 + k;
            As[k * TM + q] = vec4<f32>(a_at(m, kk, k_end), a_at(m + 1u, kk, k_end), a_at(m + 2u, kk, k_end),
                                       a_at(m + 3u, kk, k_end));
        }
        for (var u = l; u < BK * TN; u += THREADS) {
            var k: u32;
            var q: u32;
            if (prm.b_kfast != 0u) {
                k = u % BK;
                q = u / BK;
            } else {
                q = u % TN;
                k = u / TN;
            }
            let n = n0 + 4u * q;
            let kk = k0 + k;
            Bs[k * TN + q] = vec4<f32>(b_at(kk, n, k_end), b_at(kk, n + 1u, k_end), b_at(kk, n + 2u, k_end),
                                       b_at(kk, n + 3u, k_end));
        }
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let a = As[k * TM + tm];
            let b = Bs[k * TN + tn];
            acc0 = fma(vec4<f32>(a.x), b, acc0);
            acc1 = fma(vec4<f32>(a.y), b, acc1);
            acc2 = fma(vec4<f32>(a.z), b, acc2);
            acc3 = fma(vec4<f32>(a.w), b, acc3);
        }
        workgroupBarrier();
    }
    let m = m0 + 4u * tm;
    let n = n0 + 4u * tn;
    store_row(m, n, z, acc0);
    store_row(m + 1u, n, z, acc1);
    store_row(m + 2u, n, z, acc2);
    store_row(m + 3u, n, z, acc3);
}
