// Global grad norm, pass 1: Partial[w] = sum of G[i]^2 over workgroup w's 4096 elements (thread t takes
// i = w * 4096 + e * 256 + t for e = 0..15 in order, then workgroup_reduce.wgsl's fixed tree). A NaN/inf
// gradient makes its partial (and so the norm) non-finite, which the finalize pass turns into a skipped step.
// 2-D grid.

struct Params {
    n: u32,
    n_wg: u32,
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read_write> Partial: array<f32>;

const WG: u32 = 256u;
const PER_THREAD: u32 = 16u;
alias Reduced = f32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = wid.x + wid.y * nwg.x;
    if (w >= prm.n_wg) {
        return;
    }
    var s = 0.0;
    for (var e = 0u; e < PER_THREAD; e++) {
        let i = w * WG * PER_THREAD + e * WG + lid;
        if (i < prm.n) {
            let g = G[i];
            s = fma(g, g, s);
        }
    }
    let total = workgroup_reduce(lid, s);
    if (lid == 0u) {
        Partial[w] = total;
    }
}
