// Causal (optionally sliding-window) GQA attention backward, pass 2: dK and dV per kv head, no atomics.
// Workgroup = (block of BQ key rows, kv head g); thread = one key row j. The thread sums, in a fixed order
// (query heads h of the group ascending, then queries i >= j ascending), with p = exp(s - L[h, i]):
//   dV_j += p dO_i,   ds = p (dO_i . v_j - delta[h, i]),   dK_j += ds (q_i * scale).
// Query rows, dO rows, L and delta are staged BK at a time in workgroup memory; rows as D/4 vec4s.

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> K: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> V: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> dO: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> L: array<f32>;
@group(0) @binding(6) var<storage, read> Delta: array<f32>;
@group(0) @binding(7) var<storage, read_write> dK: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> dV: array<vec4<f32>>;

var<workgroup> Qs: array<vec4<f32>, ${BKDV}>;
var<workgroup> dOs: array<vec4<f32>, ${BKDV}>;
var<workgroup> Ls: array<f32, BK>;
var<workgroup> Ds: array<f32, BK>;

@compute @workgroup_size(${BQ})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wid.y;
    let ratio = prm.HQ / prm.HKV;
    let j0 = wid.x * BQ;
    let j = j0 + lid;
    let live = j < prm.T;
    var k: array<vec4<f32>, DV>;
    var v: array<vec4<f32>, DV>;
    var dk: array<vec4<f32>, DV>;
    var dv: array<vec4<f32>, DV>;
    for (var d = 0u; d < DV; d++) {
        k[d] = vec4<f32>(0.0);
        v[d] = vec4<f32>(0.0);
        dk[d] = vec4<f32>(0.0);
        dv[d] = vec4<f32>(0.0);
    }
    if (live) {
        let row = (j * prm.HKV + g) * DV;
        for (var d = 0u; d < DV; d++) {
            k[d] = K[row + d];
            v[d] = V[row + d];
        }
    }
    // queries j0 .. T-1; with a window W, only those before j0 + BQ - 1 + W see a key of the block
    var i_end = prm.T;
    if (prm.window > 0u) {
        i_end = min(prm.T, j0 + BQ - 1u + prm.window);
    }
    let n_tiles = (i_end - j0 + BK - 1u) / BK;
    for (var hh = 0u; hh < ratio; hh++) {
        let h = g * ratio + hh;
        for (var tile = 0u; tile < n_tiles; tile++) {
            let i0 = j0 + tile * BK;
            workgroupBarrier();
            for (var u = lid; u < BK * DV; u += BQ) {
                let i = i0 + u / DV;
                var qv = vec4<f32>(0.0);
                var gv = vec4<f32>(0.0);
                if (i < prm.T) {
                    let src = (i * prm.HQ + h) * DV + u % DV;
                    qv = Q[src] * prm.scale;
                    gv = dO[src];
                }
                Qs[u] = qv;
                dOs[u] = gv;
            }
            for (var u = lid; u < BK; u += BQ) {
                let i = i0 + u;
                var lv = 0.0;
                var dv0 = 0.0;
                if (i < prm.T) {
                    lv = L[h * prm.T + i];
                    dv0 = Delta[h * prm.T + i];
                }
                Ls[u] = lv;
                Ds[u] = dv0;
            }
            workgroupBarrier();
            if (live) {
                for (var ii = 0u; ii < BK; ii++) {
                    let i = i0 + ii;
                    var s = 0.0;
                    var dp = 0.0;
                    for (var d = 0u; d < DV; d++) {
                        s += dot(Qs[ii * DV + d], k[d]);
                        dp += dot(dOs[ii * DV + d], v[d]);
                    }
                    let p = select(exp(s - Ls[ii]), 0.0, masked(i, j) || i >= prm.T);
                    let pv = vec4<f32>(p);
                    let ds = vec4<f32>(p * (dp - Ds[ii]));
                    for (var d = 0u; d < DV; d++) {
                        dv[d] = fma(pv, dOs[ii * DV + d], dv[d]);
                        dk[d] = fma(ds, Qs[ii * DV + d], dk[d]);
                    }
                }
            }
        }
    }
    if (live) {
        let row = (j * prm.HKV + g) * DV;
        for (var d = 0u; d < DV; d++) {
            dK[row + d] = dk[d];
            dV[row + d] = dv[d];
        }
    }
}
