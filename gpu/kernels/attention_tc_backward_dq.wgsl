// Causal GQA attention backward on tensor cores, pass 1: dQ. Workgroup = BR query rows of head h of sequence
// z (wid.z; Params says where each sequence lies); subgroup
// sg owns 16 of them with their left matrices of Q and dO in registers. Per key tile (K, V staged):
//   S = Q K^T -> P = exp(S * scale - L) (masked, f16, this subgroup's Ps);  dP = dO V^T (f32, Ss);
//   dS = P (dP - delta) * scale (f16, over P);   dQ += dS K   (f32 result matrices).
// dO16 holds dO * sigma (pack_f16.wgsl, SCALED) and delta is scaled alike; dQ is unscaled at the end.

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q16: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> V16: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> dO16: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> L: array<f32>;
@group(0) @binding(6) var<storage, read> stats: Stats;
@group(0) @binding(7) var<storage, read_write> dQ: array<vec4<f32>>;

struct Stats {
    max_bits: u32,
    delta: array<f32>,
};

var<workgroup> Ks: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Vs: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Ss: array<array<f32, 16 * LDS>, NSG>;   // S, then dP, then dQ blocks on their way out
var<workgroup> Ps: array<array<f16, 16 * LDP>, NSG>;   // P, then dS * scale
${DP_ARRAY}${STAGE_FNS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.y;
    let z = wid.z;
    let g = h / (prm.HQ / prm.HKV);
    let w0 = (nwg.x - 1u - wid.x) * BR;   // the longest rows (most key tiles) first
    let zr = z * prm.TP;
    let i0 = w0 + sg * 16u;
    let r = lane & 15u;
    let half = lane >> 4u;
    let xb = r * LDS + 2u * half;   // this lane's first column pair of a row of Ss
    let i = i0 + r;
    let sigma = grad_scale(stats.max_bits);
    let row = h * prm.T + min(i, prm.T - 1u);
    let lse = L[z * prm.LS + row];
    let delta = stats.delta[z * prm.HQ * prm.T + row] * sigma;
${Q_LOAD}
${DO_LOAD}
${DQ_DECL}
    let n_keys = min(w0 + BR, prm.T);
    let n_tiles = (n_keys + BC - 1u) / BC;
    // the key tile's K and V go through registers: the next tile's loads are in flight during this tile's work
${PREFETCH_FIRST}
    for (var t = 0u; t < n_tiles; t++) {
        let j0 = t * BC;
        workgroupBarrier();
${PREFETCH_STORE}
        workgroupBarrier();
        if (t + 1u < n_tiles) {
${PREFETCH_NEXT}
        }
${TILE_BODY}
    }
    let inv = 1.0 / sigma;
    let ob = (((z * prm.T + i) * prm.HQ + h) * D + half * 8u) / 4u;
${DQ_STORE}
}
