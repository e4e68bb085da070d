// Embedding gather: Y[t, :] = table[ids[t], :], the table decoded in-kernel (any weight type with a
// decode_<type>.wgsl snippet). One thread per 4 consecutive outputs (row_vec4.wgsl).

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

fn out4(t: u32, col: u32, i: u32) {
    Y[i] = decode4(min(ids[t], prm.V - 1u), col, prm.H);
}
