// Per-item skeleton: one thread per item over a 2-D grid of WG-thread workgroups (gpu/ops/common.py grid). A
// kernel is this file with files that declare `const WG: u32`, `fn n_items() -> u32` and `fn item(i: u32)`,
// the work on item i (< n_items()). Used by the elementwise skeleton and the per-row kernels (kd_row,
// topk_finish, lora_reduce).

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= n_items()) {
        return;
    }
    item(i);
}
