// Causal GQA attention forward on tensor cores, flash style in one pass over the key tiles of BC, and the
// row logsumexp L[h, i] saved for the backward (as attention_forward). Workgroup = BR query rows of head h
// (reads kv head h / (HQ / HKV)) of sequence z; subgroup sg owns 16 of them and keeps their D/16 left
// matrices of Q and D/16 result matrices of O in registers. Per key tile: S = Q K^T (f32) to this subgroup's
// Ss, where the lanes mask it and take each row's tile max; P = exp(S * scale - m) (f16) to Ps, its row sums
// into l; then O += P V straight into the result matrices. The reference max m is lazy: it moves only when some
// row's tile max exceeds it by more than GROW (so P <= e^GROW stays far inside f16, and O, l in f32 are
// consistent with it), which a workgroup decides together (a flag per subgroup, read back uniformly) since the
// rescaling of O runs through Ss (result matrices are opaque: stored, each row times exp(m_old - m) by its
// lanes, loaded back). Or (one_flag) each subgroup moves its own m, writes P with it and then its flag, and one
// uniform load, whose barriers also order P's store before the P V products, decides whether any subgroup
// rescales (the others by alpha = 1, exactly). The first tile only sets m. At the end O / l leaves through Ss,
// L = m + log l. Workgroups run the longest rows (most key tiles) first.
// Q16, K16, V16: packed f16 [B TP, heads, D] as 8-half units; O: f32 [B T, HQ, D] as vec4s;
// L: f32, [HQ, T] per sequence at z LS.

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Q16: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> V16: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> O: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> L: array<f32>;

var<workgroup> Ks: array<array<f16, 16 * LDH>, NB>;    // key tile, blocks of 16 keys
var<workgroup> Vs: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Ss: array<array<f32, 16 * LDS>, NSG>;   // per subgroup: scores, O blocks being rescaled or stored
var<workgroup> Ps: array<array<f16, 16 * LDP>, NSG>;   // per subgroup: probabilities
var<workgroup> Grow: array<u32, NSG>;                  // per subgroup: some row's tile max passed m + GROW

const GROW: f32 = 8.0;   // the reference max moves when a row's tile max passes it by more (P <= e^8 in f16)
${STAGE_FNS}

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
    let w0 = (nwg.x - 1u - wid.x) * BR;
    let zr = z * prm.TP;
    let i0 = w0 + sg * 16u;
    let r = lane & 15u;
    let half = lane >> 4u;
    let i = i0 + r;
    let xb = r * LDS + 2u * half;   // this lane's first column pair of a row of Ss
${Q_LOAD}
${O_DECL}
    var m = NEG_BIG;   // the row's reference max (lazy: see above)
    var l = 0.0;       // this lane's share of the row sum of exp(S * scale - m)
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
${S_MMA}
        workgroupBarrier();
${SOFTMAX_MAX}
        let up = subgroupAny(tmax_row > m + GROW);
${FLAGS_BEFORE_P}
        let mn = select(m, max(m, tmax_row), ${MOVES});
        let alpha = exp(m - mn);
${SOFTMAX_P}
        l = l * alpha + part;
        m = mn;
${FLAGS_AFTER_P}
        if (moved && t > 0u) {   // uniform: O times alpha, row by row, through Ss
${O_RESCALE}
        }
${PV_MMA}
    }
    let lt = l + subgroupShuffleXor(l, 16u);
    let inv = 1.0 / lt;
    let ob = (((z * prm.T + i) * prm.HQ + h) * D + half * 8u) / 4u;
${O_STORE}
    if (i < prm.T && half == 0u) {
        L[z * prm.LS + h * prm.T + i] = m + log(lt);
    }
}
