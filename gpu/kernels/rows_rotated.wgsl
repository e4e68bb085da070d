// rows.wgsl's row skeleton for the kernels that rotate rows in registers (hadamard.wgsl): it also hands the
// rotation the subgroup size. Bodies: rmsnorm_i8, glu_i8, hadamard_rows.

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    row_main(row, lid);
}
