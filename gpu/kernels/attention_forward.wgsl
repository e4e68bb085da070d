// Causal (optionally sliding-window) GQA attention forward, flash style: O = softmax(Q K^T * scale) V with an online softmax over key
// tiles, and the row logsumexp L[h, i] saved for the backward. Never forms the [heads, T, T] scores.
// Workgroup = (block of BQ query rows, query head h); thread = one query row; the key/value tile of BK keys
// (kv head h / (HQ / HKV)) is staged in workgroup memory and shared by the block. Scores use the pre-scaled
// query, s = (q * scale) . k, exactly as the backward kernels recompute them. Rows are handled as D/4 vec4s.
// Q, O: [T, HQ, D]; K, V: [T, HKV, D]; L: [HQ, T].

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> K: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> V: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> O: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> L: array<f32>;


var<workgroup> Ks: array<vec4<f32>, ${BKDV}>;
var<workgroup> Vs: array<vec4<f32>, ${BKDV}>;

@compute @workgroup_size(${BQ})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let g = h / (prm.HQ / prm.HKV);
    let i0 = wid.x * BQ;
    let i = i0 + lid;
    let live = i < prm.T;
    var q: array<vec4<f32>, DV>;
    var o: array<vec4<f32>, DV>;
    for (var d = 0u; d < DV; d++) {
        o[d] = vec4<f32>(0.0);
        q[d] = vec4<f32>(0.0);
    }
    if (live) {
        for (var d = 0u; d < DV; d++) {
            q[d] = Q[(i * prm.HQ + h) * DV + d] * prm.scale;
        }
    }
    var m = NEG_BIG;
    var l = 0.0;
    let n_keys = min(i0 + BQ, prm.T);   // keys 0 .. n_keys-1 are visible to some row of the block
    let n_tiles = (n_keys + BK - 1u) / BK;
    for (var tile = first_key_tile(i0); tile < n_tiles; tile++) {
        let j0 = tile * BK;
        workgroupBarrier();
        stage_kv_tile(j0, g, lid);
        workgroupBarrier();
        if (live && j0 <= i) {
            var s: array<f32, BK>;
            var mt = m;
            for (var jj = 0u; jj < BK; jj++) {
                var acc = 0.0;
                for (var d = 0u; d < DV; d++) {
                    acc += dot(q[d], Ks[jj * DV + d]);
                }
                if (masked(i, j0 + jj)) {
                    acc = NEG_BIG;   // causal / window mask
                }
                s[jj] = acc;
                mt = max(mt, acc);
            }
            let corr = exp(m - mt);
            l *= corr;
            for (var d = 0u; d < DV; d++) {
                o[d] *= corr;
            }
            for (var jj = 0u; jj < BK; jj++) {
                let p = select(exp(s[jj] - mt), 0.0, masked(i, j0 + jj));
                l += p;
                for (var d = 0u; d < DV; d++) {
                    o[d] = fma(vec4<f32>(p), Vs[jj * DV + d], o[d]);
                }
            }
            m = mt;
        }
    }
    if (live) {
        let inv = 1.0 / l;
        for (var d = 0u; d < DV; d++) {
            O[(i * prm.HQ + h) * DV + d] = o[d] * inv;
        }
        L[h * prm.T + i] = m + log(l);
    }
}
