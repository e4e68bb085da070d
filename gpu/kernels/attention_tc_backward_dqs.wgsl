// Causal GQA attention backward on tensor cores, dQ from the dS store (gpu/codegen_attention_tc.py _DS_FNS) that
// attention_tc_backward_dkv with store_ds wrote just before: dQ = dS K per query head, with no S, P, dP or dS
// recomputed. Workgroup = BR query rows of head h (reads kv head h / (HQ / HKV)) of sequence z; subgroup sg owns
// 16 of them. Per key tile of BC = DS_BLOCK keys (one key block of the store; K staged through registers, the
// next tile's loads in flight during this one's products, and so are this subgroup's dS blocks of the next tile,
// read column-major from the store's dS^T tiles): dQ += dS K into the result matrices. The store holds
// dS * scale * sigma rounded to f16, the values the dQ pass computes; dQ is unscaled by sigma at the end.

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> DSt: array<f16>;
@group(0) @binding(3) var<storage, read> stats: Stats;
@group(0) @binding(4) var<storage, read_write> dQ: array<vec4<f32>>;

struct Stats {
    max_bits: u32,
    delta: array<f32>,
};

var<workgroup> Ks: array<array<f16, 16 * LDH>, NB>;
var<workgroup> Ss: array<array<f32, 16 * LDS>, NSG>;   // dQ blocks on their way out
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
    let w0 = (nwg.x - 1u - wid.x) * BR;   // the longest rows (most key tiles) first
    let zr = z * prm.TP;
    let i0 = w0 + sg * 16u;
    let r = lane & 15u;
    let half = lane >> 4u;
    let i = i0 + r;
    let sigma = grad_scale(stats.max_bits);
    let ds_nw = ds_blocks();
    let ds_base = ds_plane(z, h, ds_nw);
${DQ_DECL}
    let n_keys = min(w0 + BR, prm.T);
    let n_tiles = (n_keys + BC - 1u) / BC;
${PREFETCH_FIRST}
${DS_FIRST}
    for (var t = 0u; t < n_tiles; t++) {
        let j0 = t * BC;
        workgroupBarrier();
${PREFETCH_STORE}
        workgroupBarrier();
${DS_TAKE}
        if (t + 1u < n_tiles) {
${PREFETCH_NEXT}
${DS_NEXT}
        }
${DQ_MMA}
    }
    let inv = 1.0 / sigma;
    let ob = (((z * prm.T + i) * prm.HQ + h) * D + half * 8u) / 4u;
${DQ_STORE}
}
