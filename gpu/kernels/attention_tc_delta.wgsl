// Backward pre-pass of the tensor-core attention: delta[h, i] = dO[i, h] . O[i, h] (f32) and max |dO| over
// the whole tensor (atomic max of the f32 bits, which order like the values for non-negative floats), from
// which the dO scale sigma is derived (grad_scale). One invocation per (query row, head); stats.max_bits must
// be zero before the dispatch.
enable subgroups;

struct DeltaParams {
    T: u32,
    HQ: u32,
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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = (wid.x + wid.y * nwg.x) * 64u + lid;   // = i * HQ + h
    let live = row < prm.T * prm.HQ;
    var big = 0.0;
    if (live) {
        var acc = 0.0;
        for (var d = 0u; d < DV; d++) {
            let g = dO[row * DV + d];
            acc += dot(g, O[row * DV + d]);
            let a = abs(g);
            big = max(big, max(max(a.x, a.y), max(a.z, a.w)));
        }
        stats.delta[(row % prm.HQ) * prm.T + row / prm.HQ] = acc;
    }
    let m = subgroupMax(big);
    if (subgroupElect()) {
        atomicMax(&stats.max_bits, bitcast<u32>(m));
    }
}
