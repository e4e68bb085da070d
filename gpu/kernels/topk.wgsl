// Teacher top-k, per chunk of logits: merge the row's current top-k (Vals, Ids) with the chunk's nv logits
// (vocab ids v0 ..) and keep the best k, ordered by (logit descending, id ascending) -- a total order, so the
// result does not depend on the chunking. Also folds the chunk into the row's online logsumexp of z / tau,
// S[t] = (max, sum exp) (logsumexp.wgsl; the threads' states meet in workgroup_reduce.wgsl's fixed tree).
// One workgroup per row (rows.wgsl): a bitonic sort of NS (key, id) pairs in workgroup memory.

struct Params {
    T: u32,
    nv: u32,        // chunk columns (nv <= NS - k)
    ldz: u32,       // row stride of Z
    z_off: u32,     // column of the chunk's first logit inside a row of Z
    v0: u32,        // vocab id of that column
    k: u32,
    inv_tau: f32,
    first: u32,     // 1: no current list / stats yet
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Z: array<f32>;
@group(0) @binding(2) var<storage, read_write> Vals: array<f32>;
@group(0) @binding(3) var<storage, read_write> Ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<vec2<f32>>;

const NS: u32 = ${NS}u;
const WG: u32 = 256u;
const NEG_BIG: f32 = -3.0e38;
const NO_ID: u32 = 0xFFFFFFFFu;

var<workgroup> sk: array<f32, NS>;
var<workgroup> si: array<u32, NS>;

// A logsumexp state (max, sum exp).
alias Reduced = vec2<f32>;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return lse_merge(a.x, a.y, b.x, b.y);
}

// a goes before b: larger logit first, ties by smaller id.
fn before(ka: f32, ia: u32, kb: f32, ib: u32) -> bool {
    return ka > kb || (ka == kb && ia < ib);
}

fn row_main(row: u32, lid: u32) {
    let k = prm.k;
    let zb = row * prm.ldz + prm.z_off;
    var m = NEG_BIG;
    var s = 0.0;
    for (var u = lid; u < NS; u += WG) {
        var key = NEG_BIG;
        var id = NO_ID;
        if (u < k) {
            if (prm.first == 0u) {
                key = Vals[row * k + u];
                id = Ids[row * k + u];
            }
        } else if (u - k < prm.nv) {
            key = Z[zb + u - k];
            id = prm.v0 + u - k;
            let c = lse_merge(m, s, key * prm.inv_tau, 1.0);
            m = c.x;
            s = c.y;
        }
        sk[u] = key;
        si[u] = id;
    }
    for (var size = 2u; size <= NS; size <<= 1u) {
        for (var stride = size >> 1u; stride > 0u; stride >>= 1u) {
            workgroupBarrier();
            for (var p = lid; p < NS / 2u; p += WG) {
                let i = (p / stride) * 2u * stride + p % stride;
                let j = i + stride;
                let ki = sk[i];
                let ii = si[i];
                let kj = sk[j];
                let ij = si[j];
                let up = (i & size) == 0u;
                if (select(before(ki, ii, kj, ij), before(kj, ij, ki, ii), up)) {
                    sk[i] = kj;
                    si[i] = ij;
                    sk[j] = ki;
                    si[j] = ii;
                }
            }
        }
    }
    workgroupBarrier();
    for (var u = lid; u < k; u += WG) {
        Vals[row * k + u] = sk[u];
        Ids[row * k + u] = si[u];
    }
    let chunk = workgroup_reduce(lid, vec2<f32>(m, s));
    if (lid == 0u) {
        var total = chunk;
        if (prm.first == 0u) {
            total = combine(S[row], chunk);
        }
        S[row] = total;
    }
}
