// Causal GQA attention backward on tensor cores, pass 2: dK and dV of one query head. Workgroup = BR key rows
// of kv head g, paired with query head h (wid.y), of sequence z (wid.z); subgroup sg owns 16 keys with their
// left matrices of K and V in registers. Per query tile of BC (from the workgroup's first key; Q, dO, L, delta staged), with rows =
// keys and columns = queries:
//   S^T = K Q^T -> P^T = exp(S^T * scale - L) (masked, f16, Ps);  dP^T = V dO^T (f32, Ss);
//   dS^T = P^T (dP^T - delta) * scale (f16, dSs);   dV += P^T dO,   dK += dS^T Q   (f32 result matrices).
// The results are per query head, [T, HQ, D] (attention_tc_reduce.wgsl sums each kv head's group in a fixed
// order; with HQ = HKV they are dK, dV themselves), unscaled by sigma like dQ. The variant with the dS store
// (gpu/codegen_attention_tc.py store_ds) also writes each dS^T block to DSt for attention_tc_backward_dqs, in
// binding 5's place (L, then, comes from the copy attention_tc_delta.wgsl puts after delta in stats).

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q16: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> V16: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> dO16: array<vec4<u32>>;
${L_BINDING}
@group(0) @binding(6) var<storage, read> stats: Stats;
@group(0) @binding(7) var<storage, read_write> dK: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> dV: array<vec4<f32>>;

struct Stats {
    max_bits: u32,
    delta: array<f32>,
};

var<workgroup> Qs: array<array<f16, 16 * LDH>, NB>;    // query tile, blocks of 16 queries
var<workgroup> dOs: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Ss: array<array<f32, 16 * LDS>, NSG>;   // S^T, then dP^T, then dK / dV blocks on their way out
var<workgroup> Ps: array<array<f16, 16 * LDP>, NSG>;   // P^T
var<workgroup> dSs: array<array<f16, 16 * LDP>, NSG>;  // dS^T * scale
${DP_ARRAY}var<workgroup> Lc: array<f32, BC>;                     // L of this tile's queries
var<workgroup> Dc: array<f32, BC>;                     // delta * sigma of this tile's queries
${STAGE_FNS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
${NWG_PARAM}    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.y;
    let z = wid.z;
    let g = h / (prm.HQ / prm.HKV);
    let w0 = wid.x * BR;   // the first keys have the most query tiles: they run first
    let zr = z * prm.TP;
    let j0 = w0 + sg * 16u;
    let r = lane & 15u;
    let half = lane >> 4u;
    let xb = r * LDS + 2u * half;   // this lane's first column pair of a row of Ss
    let j = j0 + r;
    let sigma = grad_scale(stats.max_bits);
${DS_SETUP}${K_LOAD}
${V_LOAD}
${DKV_DECL}
    let n_tiles = (prm.T - w0 + BC - 1u) / BC;
    // the query tile's Q and dO go through registers: the next tile's loads are in flight during this tile's work
${PREFETCH_FIRST}
    for (var t = 0u; t < n_tiles; t++) {
        let i0 = w0 + t * BC;
        workgroupBarrier();
${PREFETCH_STORE}
        for (var e = lid; e < BC; e += THREADS) {
            let row = h * prm.T + min(i0 + e, prm.T - 1u);
            Lc[e] = ${LSE_AT};
            Dc[e] = stats.delta[z * prm.HQ * prm.T + row] * sigma;
        }
        workgroupBarrier();
        if (t + 1u < n_tiles) {
${PREFETCH_NEXT}
        }
${TILE_BODY}
    }
    let inv = 1.0 / sigma;
    let ob = (((z * prm.T + j) * prm.HQ + h) * D + half * 8u) / 4u;
${DKV_STORE}
}
