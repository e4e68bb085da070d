// Embedding gather: Y[t, :] = table[ids[t], :], the table decoded in-kernel (any weight type with a
// decode_<type>.wgsl snippet). One thread per 4 consecutive outputs; 2-D grid (wid.x + wid.y * nwg.x).

${DECODE}

struct Params {
    T: u32,   // rows (tokens)
    H: u32,   // row length (multiple of 4 and of the type's block)
    V: u32,   // table rows
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let hv = prm.H / 4u;
    if (i >= prm.T * hv) {
        return;
    }
    let t = i / hv;
    let id = min(ids[t], prm.V - 1u);
    Y[i] = decode4(id, (i % hv) * 4u, prm.H);
}
