// Teacher top-k, per chunk of logits: merge the row's current top-k (Vals, Ids) with the chunk's nv logits
// (vocab ids v0 ..) and keep the best k, ordered by (logit descending, id ascending) -- a total order, so the
// result does not depend on the chunking. Also folds the chunk into the row's online logsumexp of z / tau,
// S[t] = (max, sum exp) (logsumexp.wgsl; the threads' states meet in workgroup_reduce.wgsl's fixed tree).
// One workgroup per row (rows.wgsl): a bitonic sort in workgroup memory of the current list and the chunk's
// logits that beat its k-th entry (after the first chunk of a row, few do), not of all NS pairs; a chunk of any
// length, sorted whenever the candidates might outgrow the NS pairs (and once at its end).

struct Params {
    T: u32,
    nv: u32,        // chunk columns
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
const STEP: u32 = 4u * WG;   // columns between two looks at the candidates' count (NS >= k + STEP)
const NEG_BIG: f32 = -3.0e38;
const NO_ID: u32 = 0xFFFFFFFFu;

var<workgroup> sk: array<f32, NS>;
var<workgroup> si: array<u32, NS>;
var<workgroup> n_candidates: atomic<u32>;
var<workgroup> n_sorted: u32;

// A logsumexp state (max, sum exp).
alias Reduced = vec2<f32>;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return lse_merge(a.x, a.y, b.x, b.y);
}

// a goes before b: larger logit first, ties by smaller id.
fn before(ka: f32, ia: u32, kb: f32, ib: u32) -> bool {
    return ka > kb || (ka == kb && ia < ib);
}

// bitonic sort of sk / si [0, n) best first (n padded to the next power of two with placeholders); ends with
// a barrier
fn sort_pairs(n: u32, lid: u32) {
    var size = 1u;
    while (size < n) {
        size <<= 1u;
    }
    for (var u = n + lid; u < size; u += WG) {
        sk[u] = NEG_BIG;
        si[u] = NO_ID;
    }
    for (var span = 2u; span <= size; span <<= 1u) {
        for (var stride = span >> 1u; stride > 0u; stride >>= 1u) {
            workgroupBarrier();
            for (var p = lid; p < size / 2u; p += WG) {
                let i = (p / stride) * 2u * stride + p % stride;
                let j = i + stride;
                let ki = sk[i];
                let ii = si[i];
                let kj = sk[j];
                let ij = si[j];
                let up = (i & span) == 0u;
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
}

fn row_main(row: u32, lid: u32) {
    let k = prm.k;
    let zb = row * prm.ldz + prm.z_off;
    // the row's current list (best first) in 0..k-1; its last entry is what a chunk logit must beat to enter
    if (lid == 0u) {
        atomicStore(&n_candidates, 0u);
    }
    for (var u = lid; u < k; u += WG) {
        var key = NEG_BIG;
        var id = NO_ID;
        if (prm.first == 0u) {
            key = Vals[row * k + u];
            id = Ids[row * k + u];
        }
        sk[u] = key;
        si[u] = id;
    }
    workgroupBarrier();
    var last_key = sk[k - 1u];
    var last_id = si[k - 1u];
    // STEP columns a step (column c on thread c % WG): every logit enters the logsumexp; those that beat the
    // current k-th go after the list, in any order (the sort's total order makes the result independent of
    // it). The list and the candidates are sorted (and the k-th updated) only when the next step might not
    // fit, and at the end: a few sorts a chunk instead of one per NS - k columns
    var m = NEG_BIG;
    var s = 0.0;
    for (var c0 = 0u; c0 < prm.nv; c0 += STEP) {
        for (var c = c0 + lid; c < min(c0 + STEP, prm.nv); c += WG) {
            let key = Z[zb + c];
            let id = prm.v0 + c;
            let l = lse_merge(m, s, key * prm.inv_tau, 1.0);
            m = l.x;
            s = l.y;
            if (before(key, id, last_key, last_id)) {
                let at = k + atomicAdd(&n_candidates, 1u);
                sk[at] = key;
                si[at] = id;
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            n_sorted = atomicLoad(&n_candidates);
        }
        let n = workgroupUniformLoad(&n_sorted);
        if (n > 0u && (k + n + STEP > NS || c0 + STEP >= prm.nv)) {
            sort_pairs(k + n, lid);
            last_key = sk[k - 1u];
            last_id = si[k - 1u];
            if (lid == 0u) {
                atomicStore(&n_candidates, 0u);
            }
            workgroupBarrier();
        }
    }
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
