// SwiGLU forward: Y = silu(G) * U, silu(g) = g * sigmoid(g). One thread per element; 2-D grid.

@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> U: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = element_index(wid, nwg, lid);
    if (i >= prm.n) {
        return;
    }
    let g = G[i];
    Y[i] = g * sigmoid(g) * U[i];
}
