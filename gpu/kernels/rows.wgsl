// Row skeleton: one workgroup of WG threads per row, rows t < prm.T over a 2-D grid (gpu/ops/common.py
// grid(T, 1)). The body file defines `const WG: u32`, the uniform block `prm` (with the row count T) and
// `fn row_main(row: u32, lid: u32)`, the work of thread lid on its workgroup's row.
// Bodies: rmsnorm_forward, rmsnorm_backward, kd_stats, kd_grad, topk.

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    row_main(row, lid);
}
