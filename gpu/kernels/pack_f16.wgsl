// f16 copy of an f32 tensor for the tensor-core kernels (attention operands, GEMM inputs), per part z
// (wid.z: one sequence of a batch of attention operands, else the one part):
// dst[z n_total + u] = f16(src[z n_valid + u] * sigma) for the n_valid vec4 units of a part, zero for the
// units after them up to n_total (the padding rows of attention operands). SCALED: sigma = grad_scale(max |x|)
// (grad_scale.wgsl; the max from attention's delta pass or the absmax kernel), else 1.
enable f16;

struct PackParams {
    n_valid: u32,
    n_total: u32,
};

struct Stats {
    max_bits: u32,
    delta: array<f32>,
};

@group(0) @binding(0) var<uniform> prm: PackParams;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f16>>;
${STATS_BINDING}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let u = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (u >= prm.n_total) {
        return;
    }
    var x = vec4<f32>(0.0);
    if (u < prm.n_valid) {
        x = src[wid.z * prm.n_valid + u] * ${SIGMA};
    }
    dst[wid.z * prm.n_total + u] = vec4<f16>(x);
}
