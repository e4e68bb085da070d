// Causal GQA attention forward on tensor cores, flash style in two passes over the key tiles of BC, and the
// row logsumexp L[h, i] saved for the backward (as attention_forward). Workgroup = BR query rows of head h
// (reads kv head h / (HQ / HKV)); subgroup sg owns 16 of them and keeps their D/16 left matrices of Q in
// registers. Pass 1: S = Q K^T (f32) to this subgroup's Ss, where the lanes mask it and keep the online row
// max and sum (f32) -> L. Pass 2: S again, P = exp(S * scale - L) (already normalised, f16), O += P V in f32
// result matrices. The result matrices are opaque (a row can be rescaled only through workgroup memory),
// so computing S twice (1.5x the forward's products) replaces rescaling O whenever a row's max moves.
// Q16, K16, V16: packed f16 [T_pad, heads, D] as 8-half units; O: f32 [T, HQ, D];
// L: f32 [HQ, T].

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q16: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> V16: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> O: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> L: array<f32>;

var<workgroup> Ks: array<array<f16, 16 * LDH>, NB>;    // key tile, blocks of 16 keys
var<workgroup> Vs: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Ss: array<array<f32, 16 * LDS>, NSG>;   // per subgroup: scores, then O blocks on their way out
var<workgroup> Ps: array<array<f16, 16 * LDP>, NSG>;   // per subgroup: probabilities
${STAGE_FNS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.y;
    let g = h / (prm.HQ / prm.HKV);
    let w0 = wid.x * BR;
    let i0 = w0 + sg * 16u;
    let r = lane & 15u;
    let half = lane >> 4u;
    let i = i0 + r;
${Q_LOAD}
${O_DECL}
    // pass 1: the row max and sum over all key tiles (online, per lane, f32) -> the logsumexp L of each row
    var m = NEG_BIG;
    var l = 0.0;   // this lane's share of the row sum of exp(S * scale - m)
    let n_keys = min(w0 + BR, prm.T);
    let n_tiles = (n_keys + BC - 1u) / BC;
    for (var t = 0u; t < n_tiles; t++) {
        let j0 = t * BC;
        workgroupBarrier();
        stage_Ks_K16(j0, g, prm.HKV, lid);
        workgroupBarrier();
${S_MMA}
        workgroupBarrier();
        var tmax = NEG_BIG;
        for (var k = 0u; k < BC / 2u; k++) {
            let c = 4u * (k >> 1u) + 2u * half + (k & 1u);
            tmax = max(tmax, select(NEG_BIG, Ss[sg][r * LDS + c] * prm.scale, j0 + c <= i));
        }
        let mn = max(m, max(tmax, subgroupShuffleXor(tmax, 16u)));
        var part = 0.0;
        for (var k = 0u; k < BC / 2u; k++) {
            let c = 4u * (k >> 1u) + 2u * half + (k & 1u);
            part += select(0.0, exp(Ss[sg][r * LDS + c] * prm.scale - mn), j0 + c <= i);
        }
        l = l * exp(m - mn) + part;
        m = mn;
    }
    let lse = m + log(l + subgroupShuffleXor(l, 16u));
    // pass 2: P = exp(S * scale - L) is final (no rescaling of O); O += P V
    for (var t = 0u; t < n_tiles; t++) {
        let j0 = t * BC;
        workgroupBarrier();
        stage_Ks_K16(j0, g, prm.HKV, lid);
        stage_Vs_V16(j0, g, prm.HKV, lid);
        workgroupBarrier();
${S_MMA}
        workgroupBarrier();
        for (var k = 0u; k < BC / 2u; k++) {
            let c = 4u * (k >> 1u) + 2u * half + (k & 1u);
            Ps[sg][r * LDP + c] = f16(select(0.0, exp(Ss[sg][r * LDS + c] * prm.scale - lse), j0 + c <= i));
        }
        workgroupBarrier();
${PV_MMA}
    }
    let inv = 1.0;
    let ob = ((i * prm.HQ + h) * D + half * 8u) / 4u;
${O_STORE}
    if (half == 0u && i < prm.T) {
        L[h * prm.T + i] = lse;
    }
}
