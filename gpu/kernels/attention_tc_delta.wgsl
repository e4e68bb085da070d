// Backward pre-pass of the tensor-core attention over a batch of B sequences (dO, O: [B T, HQ, D]):
// delta[z, h, i] = dO[z T + i, h] . O[z T + i, h] (f32) and max |dO| over the whole batch (atomic max of the f32 bits, which order like the values for non-negative floats), from
// which the dO scale sigma is derived (grad_scale), and a copy of the row's logsumexp after the B HQ T deltas
// (for attention_tc_backward_dkv with the dS store, which binds the store in L's place). One invocation per
// (query row, head); stats.max_bits must be zero before the dispatch.
enable subgroups;

struct DeltaParams {
    T: u32,
    HQ: u32,
    B: u32,
    LS: u32,   // floats per sequence of L
};

struct Stats {
    max_bits: atomic<u32>,
    delta: array<f32>,
};

const DV: u32 = ${DV}u;   // head_dim / 4

@group(0) @binding(0) var<uniform> prm: DeltaParams;
@group(0) @binding(1) var<storage, read> dO: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> O: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> stats: Stats;
@group(0) @binding(4) var<storage, read> L: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = (wid.x + wid.y * nwg.x) * 64u + lid;   // = (z T + i) HQ + h
    let live = row < prm.B * prm.T * prm.HQ;
    var big = 0.0;
    if (live) {
        var acc = 0.0;
        for (var d = 0u; d < DV; d++) {
            let g = dO[row * DV + d];
            acc += dot(g, O[row * DV + d]);
            let a = abs(g);
            big = max(big, max(max(a.x, a.y), max(a.z, a.w)));
        }
        let zi = row / prm.HQ;
        let z = zi / prm.T;
        let at = (row % prm.HQ) * prm.T + zi % prm.T;   // h T + i
        stats.delta[z * prm.HQ * prm.T + at] = acc;
        stats.delta[(prm.B + z) * prm.HQ * prm.T + at] = L[z * prm.LS + at];
    }
    let m = subgroupMax(big);
    if (subgroupElect()) {
        atomicMax(&stats.max_bits, bitcast<u32>(m));
    }
}
