// A frozen weight's int8 codes for the integer GEMM, decoded in-kernel from its GGML type: per row n,
// S[n] = max |W[n, :]| / 127 and Q[n, k] = round(W[n, k] / S[n]) (ties to even, |q| <= 127; an all-zero row gives
// S = 0 and codes 0), four codes per u32 word. model/int8.py quantize_i8 with one chunk per row is the twin.
// A workgroup per row (2-D grid: wid.x + wid.y * nwg.x); the absmax by workgroup_reduce.wgsl, codes by int8_codes.wgsl.

${DECODE}

struct Params {
    N: u32,   // rows
    K: u32,   // row length (multiple of 4 and of the type's block)
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(2) var<storage, read_write> Q: array<u32>;
@group(0) @binding(3) var<storage, read_write> S: array<f32>;

const WG: u32 = 256u;
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n = min(wid.x + wid.y * nwg.x, prm.N - 1u);   // extra workgroups of the grid redo the last row
    var m = 0.0;
    for (var w = lid; w < prm.K / 4u; w += WG) {
        let v = abs(decode4(n, 4u * w, prm.K));
        m = max(m, max(max(v.x, v.y), max(v.z, v.w)));
    }
    let scale = workgroup_reduce(lid, m) / 127.0;
    for (var w = lid; w < prm.K / 4u; w += WG) {
        Q[n * (prm.K / 4u) + w] = pack4(decode4(n, 4u * w, prm.K), scale);
    }
    if (lid == 0u) {
        S[n] = scale;
    }
}
