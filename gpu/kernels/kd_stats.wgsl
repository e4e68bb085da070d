// KD head, pass 1, per vocab chunk: fold the chunk's logits Z[t, 0..nv) (vocab ids c0..c0+nv) into each row's
// running (max, sum exp) at temperature tau and at 1 -- S[t] = (m_tau, s_tau, m_1, s_1) -- and gather the
// student logits at the teacher ids and at the target: ZG[t, j] = z[ids[t, j]], ZG[t, k] = z[target[t]].
// One workgroup per row: per-thread online sums over a strided set of columns, then a fixed tree.

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
@group(0) @binding(1) var<storage, read> Z: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> targets: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> ZG: array<f32>;

const WG: u32 = 64u;
const NEG_BIG: f32 = -3.0e38;
var<workgroup> r_mt: array<f32, WG>;
var<workgroup> r_st: array<f32, WG>;
var<workgroup> r_m1: array<f32, WG>;
var<workgroup> r_s1: array<f32, WG>;

// (m, s) of two partial logsumexp states combined.
fn comb(ma: f32, sa: f32, mb: f32, sb: f32) -> vec2<f32> {
    let m = max(ma, mb);
    return vec2<f32>(m, sa * exp(ma - m) + sb * exp(mb - m));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    let base = row * prm.ldz;
    var mt = NEG_BIG;
    var st = 0.0;
    var m1 = NEG_BIG;
    var s1 = 0.0;
    for (var c = lid; c < prm.nv; c += WG) {
        let z = Z[base + c];
        let a = comb(m1, s1, z, 1.0);
        m1 = a.x;
        s1 = a.y;
        let b = comb(mt, st, z * prm.inv_tau, 1.0);
        mt = b.x;
        st = b.y;
    }
    r_mt[lid] = mt;
    r_st[lid] = st;
    r_m1[lid] = m1;
    r_s1[lid] = s1;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if (lid < w) {
            let a = comb(r_mt[lid], r_st[lid], r_mt[lid + w], r_st[lid + w]);
            let b = comb(r_m1[lid], r_s1[lid], r_m1[lid + w], r_s1[lid + w]);
            r_mt[lid] = a.x;
            r_st[lid] = a.y;
            r_m1[lid] = b.x;
            r_s1[lid] = b.y;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var out = vec4<f32>(r_mt[0], r_st[0], r_m1[0], r_s1[0]);
        if (prm.first == 0u) {
            let old = S[row];
            let a = comb(old.x, old.y, out.x, out.y);
            let b = comb(old.z, old.w, out.z, out.w);
            out = vec4<f32>(a, b);
        }
        S[row] = out;
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
}
