// Causal (optionally sliding-window) GQA attention backward, pass 1: dQ and the row term delta[h, i] = dO[i, h] . O[i, h].
// Scores are recomputed tile by tile from the saved logsumexp L (p = exp(s - L)), never materialised:
//   dp = dO_i . v_j,  ds = p (dp - delta_i),  dQ_i = scale * sum_j ds k_j   (keys in ascending order).
// Same workgroup/thread layout, vec4 rows and key tiles as attention_forward.wgsl.

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> K: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> V: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> O: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> dO: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> L: array<f32>;
@group(0) @binding(7) var<storage, read_write> dQ: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> Delta: array<f32>;


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
    var go: array<vec4<f32>, DV>;
    var dq: array<vec4<f32>, DV>;
    var delta = 0.0;
    var lse = 0.0;
    for (var d = 0u; d < DV; d++) {
        q[d] = vec4<f32>(0.0);
        go[d] = vec4<f32>(0.0);
        dq[d] = vec4<f32>(0.0);
    }
    if (live) {
        let row = (i * prm.HQ + h) * DV;
        for (var d = 0u; d < DV; d++) {
            q[d] = Q[row + d] * prm.scale;
            go[d] = dO[row + d];
            delta += dot(go[d], O[row + d]);
        }
        lse = L[h * prm.T + i];
    }
    let n_keys = min(i0 + BQ, prm.T);
    let n_tiles = (n_keys + BK - 1u) / BK;
    for (var tile = first_key_tile(i0); tile < n_tiles; tile++) {
        let j0 = tile * BK;
        workgroupBarrier();
        stage_kv_tile(j0, g, lid);
        workgroupBarrier();
        if (live && j0 <= i) {
            for (var jj = 0u; jj < BK; jj++) {
                var s = 0.0;
                var dp = 0.0;
                for (var d = 0u; d < DV; d++) {
                    s += dot(q[d], Ks[jj * DV + d]);
                    dp += dot(go[d], Vs[jj * DV + d]);
                }
                let p = select(exp(s - lse), 0.0, masked(i, j0 + jj));
                let ds = vec4<f32>(p * (dp - delta));
                for (var d = 0u; d < DV; d++) {
                    dq[d] = fma(ds, Ks[jj * DV + d], dq[d]);
                }
            }
        }
    }
    if (live) {
        let row = (i * prm.HQ + h) * DV;
        for (var d = 0u; d < DV; d++) {
            dQ[row + d] = dq[d] * prm.scale;
        }
        Delta[h * prm.T + i] = delta;
    }
}
