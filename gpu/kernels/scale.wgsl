// In-place scale: Y *= alpha (e.g. gradients averaged over accumulated micro-batches). One thread per element.

@group(0) @binding(1) var<storage, read_write> Y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = element_index(wid, nwg, lid);
    if (i >= prm.n) {
        return;
    }
    Y[i] = Y[i] * prm.alpha;
}
