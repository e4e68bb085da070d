// LoRA's skinny f32 products (gpu/ops/lora_matmul.py), with arbitrary strides:
//   A(m, k) = A[a_off + m * sam + k * sak],  B(k, n) = B[b_off + k * sbk + n * sbn],
//   direct:  C[c_off + m * csm + n * csn] = alpha * sum_k A(m, k) B(k, n)  (+ that element if accumulate)
//   partial: C[z * M * N + m * N + n] = sum over k in [z * chunk, (z + 1) * chunk) (lora_reduce adds them up)
// Column groups (gw > 0: products sharing A, e.g. t = x A^T of the projections reading the same x): column n is
// column n % gw of group n / gw, whose B and C start b_go / c_go elements further (B(k, n) = B[b_off + b_go[g] +
// k * sbk + (n % gw) * sbn], C likewise), so several adapters' products read A once, in one dispatch.
// The reduction axis is split over grid z (chunk per workgroup), so a long reduction (over T tokens, or over
// d) runs on many workgroups. BM x BN outputs per workgroup, 4 x 4 per thread: rows m0 + tm + TM * i and
// columns n0 + tn + TN * c (i, c < 4), so neighbouring threads load, store and accumulate neighbouring
// elements. BK steps are staged in workgroup memory as vec4s of those 4 rows (columns) at one k, loaded by
// threads walking the operand's contiguous axis (a_kfast / b_kfast) so the loads coalesce; rows padded by
// one vec4 against bank conflicts. Each thread's loads of a step are unrolled (gpu/codegen_lora.py writes
// the DECLARE, LOAD and STAGE statements) and the next step's are issued before this step's products; the epilogue reads
// every C value it accumulates onto before storing. Every sum runs in ascending k: reproducible, no atomics.

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
    gw: u32,         // columns per group (0: one group, the plain product)
    _pad0: u32,
    b_go: vec4<u32>, // per group: B's and C's offsets (elements) past b_off / c_off
    c_go: vec4<u32>,
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
const SA: u32 = TM + 1u;   // padded row strides of the staged tiles
const SB: u32 = TN + 1u;
var<workgroup> As: array<vec4<f32>, BK * SA>;   // As[k * SA + q][i] = A(m0 + q + TM * i, k0 + k)
var<workgroup> Bs: array<vec4<f32>, BK * SB>;   // Bs[k * SB + q][c] = B(k0 + k, n0 + q + TN * c)

fn a_at(m: u32, k: u32, k_end: u32) -> f32 {
    if (m < prm.M && k < k_end) {
        return A[prm.a_off + m * prm.sam + k * prm.sak];
    }
    return 0.0;
}

// (group, column within the group) of column n
fn group_of(n: u32) -> vec2<u32> {
    if (prm.gw == 0u) {
        return vec2<u32>(0u, n);
    }
    return vec2<u32>(n / prm.gw, n % prm.gw);
}

fn b_at(k: u32, n: u32, k_end: u32) -> f32 {
    if (n < prm.N && k < k_end) {
        let g = group_of(n);
        return B[prm.b_off + prm.b_go[g.x] + k * prm.sbk + g.y * prm.sbn];
    }
    return 0.0;
}

// (k, q) of staging unit u: k fastest when the operand is contiguous along k, else q fastest.
fn unit(u: u32, kfast: u32, q_count: u32) -> vec2<u32> {
    if (kfast != 0u) {
        return vec2<u32>(u % BK, u / BK);
    }
    return vec2<u32>(u / q_count, u % q_count);
}

fn load_a(u: u32, m0: u32, n0: u32, k0: u32, k_end: u32) -> vec4<f32> {
    let kq = unit(u, prm.a_kfast, TM);
    let m = m0 + kq.y;
    let k = k0 + kq.x;
    return vec4<f32>(a_at(m, k, k_end), a_at(m + TM, k, k_end), a_at(m + 2u * TM, k, k_end),
                     a_at(m + 3u * TM, k, k_end));
}

fn load_b(u: u32, m0: u32, n0: u32, k0: u32, k_end: u32) -> vec4<f32> {
    let kq = unit(u, prm.b_kfast, TN);
    let n = n0 + kq.y;
    let k = k0 + kq.x;
    return vec4<f32>(b_at(k, n, k_end), b_at(k, n + TN, k_end), b_at(k, n + 2u * TN, k_end),
                     b_at(k, n + 3u * TN, k_end));
}

fn stage_a(u: u32, v: vec4<f32>) {
    let kq = unit(u, prm.a_kfast, TM);
    As[kq.x * SA + kq.y] = v;
}

fn stage_b(u: u32, v: vec4<f32>) {
    let kq = unit(u, prm.b_kfast, TN);
    Bs[kq.x * SB + kq.y] = v;
}

fn out_index(m: u32, n: u32, z: u32) -> u32 {
    if (prm.partial != 0u) {
        return (z * prm.M + m) * prm.N + n;
    }
    let g = group_of(n);
    return prm.c_off + prm.c_go[g.x] + m * prm.csm + g.y * prm.csn;
}

fn old_at(m: u32, n: u32) -> f32 {
    if (m < prm.M && n < prm.N) {
        return C[out_index(m, n, 0u)];
    }
    return 0.0;
}

// C's current values at row m, columns n0 + TN * c (0 outside), read before any store so the reads overlap.
fn old_row(m: u32, n0: u32) -> vec4<f32> {
    return vec4<f32>(old_at(m, n0), old_at(m, n0 + TN), old_at(m, n0 + 2u * TN), old_at(m, n0 + 3u * TN));
}

fn put(m: u32, n: u32, z: u32, v: f32) {
    if (m < prm.M && n < prm.N) {
        C[out_index(m, n, z)] = v;
    }
}

fn store_row(m: u32, n0: u32, z: u32, v: vec4<f32>) {
    put(m, n0, z, v.x);
    put(m, n0 + TN, z, v.y);
    put(m, n0 + 2u * TN, z, v.z);
    put(m, n0 + 3u * TN, z, v.w);
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let m0 = wid.x * BM;
    let n0 = wid.y * BN;
    let z = wid.z;
    let k_begin = z * prm.chunk;
    let k_end = min(prm.K, k_begin + prm.chunk);
    let tn = l % TN;
    let tm = l / TN;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    ${DECLARE}
    if (k_begin < k_end) {
        let kl = k_begin;
        ${LOAD}
    }
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        ${STAGE}
        workgroupBarrier();
        if (k0 + BK < k_end) {
            let kl = k0 + BK;   // the next step's loads, in flight during this step's products
            ${LOAD}
        }
        for (var k = 0u; k < BK; k++) {
            let a = As[k * SA + tm];
            let b = Bs[k * SB + tn];
            acc0 = fma(vec4<f32>(a.x), b, acc0);
            acc1 = fma(vec4<f32>(a.y), b, acc1);
            acc2 = fma(vec4<f32>(a.z), b, acc2);
            acc3 = fma(vec4<f32>(a.w), b, acc3);
        }
        workgroupBarrier();
    }
    let m = m0 + tm;
    let n = n0 + tn;
    if (prm.partial != 0u) {
        store_row(m, n, z, acc0);
        store_row(m + TM, n, z, acc1);
        store_row(m + 2u * TM, n, z, acc2);
        store_row(m + 3u * TM, n, z, acc3);
        return;
    }
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    if (prm.accumulate != 0u) {
        o0 = old_row(m, n);
        o1 = old_row(m + TM, n);
        o2 = old_row(m + 2u * TM, n);
        o3 = old_row(m + 3u * TM, n);
    }
    let alpha = vec4<f32>(prm.alpha);
    store_row(m, n, 0u, alpha * acc0 + o0);
    store_row(m + TM, n, 0u, alpha * acc1 + o1);
    store_row(m + 2u * TM, n, 0u, alpha * acc2 + o2);
    store_row(m + 3u * TM, n, 0u, alpha * acc3 + o3);
}
