// KD head, pass 1, per vocab chunk: fold the chunk's logits Z[t, 0..nv) (vocab ids c0..c0+nv) into each row's
// running (max, sum exp) at temperature tau and at 1 -- S[t] = (m_tau, s_tau, m_1, s_1) -- and gather the
// student logits at the teacher ids and at the target: ZG[t, j] = z[ids[t, j]], ZG[t, k] = z[target[t]].
// One workgroup per row (rows.wgsl): per-thread online sums (logsumexp.wgsl) over a strided set of columns, then
// workgroup_reduce.wgsl's fixed tree. The part before this file declares Z (@binding(1)) and
// `emit_probs(row, lid, m_old, m_new)`, called by every thread last: nothing (kd_stats_plain.wgsl), or the chunk's
// probabilities against the running max for the one-pass backward (kd_probs_f32.wgsl, kd_probs_f16.wgsl).

struct Params {
    T: u32,
    nv: u32,        // valid columns in this chunk
    ldz: u32,       // row stride of Z
    c0: u32,        // vocab id of column 0
    k: u32,
    inv_tau: f32,
    first: u32,     // 1: first chunk (initialise S)
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> targets: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> ZG: array<f32>;

const WG: u32 = 64u;
const NEG_BIG: f32 = -3.0e38;

// Two logsumexp states side by side: (m_tau, s_tau, m_1, s_1).
alias Reduced = vec4<f32>;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec4<f32>(lse_merge(a.x, a.y, b.x, b.y), lse_merge(a.z, a.w, b.z, b.w));
}

fn row_main(row: u32, lid: u32) {
    let base = row * prm.ldz;
    let before = S[row];  // read by every thread before thread 0 writes it (unset on the first chunk)
    var mt = NEG_BIG;
    var st = 0.0;
    var m1 = NEG_BIG;
    var s1 = 0.0;
    for (var c = lid; c < prm.nv; c += WG) {
        let z = Z[base + c];
        let a = lse_merge(m1, s1, z, 1.0);
        m1 = a.x;
        s1 = a.y;
        let b = lse_merge(mt, st, z * prm.inv_tau, 1.0);
        mt = b.x;
        st = b.y;
    }
    let chunk = workgroup_reduce(lid, vec4<f32>(mt, st, m1, s1));
    var total = chunk;
    if (prm.first == 0u) {
        total = combine(before, chunk);
    }
    if (lid == 0u) {
        S[row] = total;
    }
    let kk = prm.k + 1u;
    for (var j = lid; j < kk; j += WG) {
        var id: u32;
        if (j < prm.k) {
            id = ids[row * prm.k + j];
        } else {
            id = targets[row];
        }
        if (id >= prm.c0 && id - prm.c0 < prm.nv) {
            ZG[row * kk + j] = Z[base + id - prm.c0];
        }
    }
    emit_probs(row, lid, before.x, total.x);
}
