// Skeleton: one thread per 4 consecutive outputs of prm.T rows of prm.H (a multiple of 4) over a 2-D grid of
// 64-thread workgroups (gpu/ops/common.py grid(T * H / 4, 64)). The body file defines the uniform block `prm` (with
// T and H) and `fn out4(t: u32, col: u32, i: u32)`, the work on outputs col .. col + 3 of row t (vec4 index i).
// Bodies: embedding, kd_finish.

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let hv = prm.H / 4u;
    if (i >= prm.T * hv) {
        return;
    }
    out4(i / hv, (i % hv) * 4u, i);
}
