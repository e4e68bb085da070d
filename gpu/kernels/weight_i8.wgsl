// A frozen weight's int8 codes for the integer GEMM, decoded in-kernel from its GGML type: per row n,
// S[n] = max |W[n, :]| / 127 and Q[n, k] = round(W[n, k] / S[n]) (ties to even, |q| <= 127; an all-zero row gives
// S = 0 and codes 0), four codes per u32 word. model/int8.py quantize_i8 with one chunk per row is the twin.
// A workgroup per row (2-D grid: wid.x + wid.y * nwg.x), decoding each value once: int8_codes.wgsl codes_of_row
// holds the row in registers for its absmax (workgroup_reduce.wgsl) and its codes. FIXED_SCALE: S[n] holds the
// row's scale already (an earlier decode's): the codes alone, no absmax (the same codes).

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

var<private> row_n: u32;   // this workgroup's row

const ABSMAX: bool = !${FIXED};   // fixed: S holds the row's scale already (int8_codes.wgsl)
fn row_scale(lid: u32, m: f32) -> f32 {
    if (!ABSMAX) {
        return S[row_n];
    }
    return workgroup_reduce(lid, m) / 127.0;
}

fn group4(w: u32) -> vec4<f32> {
    return decode4(row_n, 4u * w, prm.K);
}

const WG: u32 = 256u;
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    row_n = min(wid.x + wid.y * nwg.x, prm.N - 1u);   // extra workgroups of the grid redo the last row
    let scale = codes_of_row(lid, prm.K / 4u, row_n * (prm.K / 4u), 0u);
    if (lid == 0u && ABSMAX) {
        S[row_n] = scale;
    }
}
