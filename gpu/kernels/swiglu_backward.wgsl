// SwiGLU backward: dG = dY * U * sig * (1 + g * (1 - sig)), dU = dY * g * sig. One thread per element.

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;
@group(0) @binding(5) var<storage, read_write> dU: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = element_index(wid, nwg, lid);
    if (i >= prm.n) {
        return;
    }
    let g = G[i];
    let dy = dY[i];
    let sig = sigmoid(g);
    dG[i] = dy * U[i] * sig * (1.0 + g * (1.0 - sig));
    dU[i] = dy * g * sig;
}
