// A weight's rows as f16 (gpu/ops/half.py weight_to_f16; per-item skeleton threads.wgsl after this file):
// O[n, k .. k + 7] = W[n, k .. k + 7] through the tensor-core GEMM's loader of W's type (gpu/codegen_tc.py
// weight_loader: the same arithmetic and f16 rounding as its staging), so a GEMM over the decoded rows (plain F16
// staging) multiplies the very values a GEMM decoding W as it stages would. Item i = 8 weights; K % 8 == 0.
enable f16;

struct Params {
    n: u32,   // rows
    K: u32,   // row length
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(2) var<storage, read_write> O: array<vec4<u32>>;

struct H8 {
    lo: vec4<f16>,
    hi: vec4<f16>,
}

${DECODE}

const WG: u32 = 256u;

fn n_items() -> u32 {
    return prm.n * (prm.K / 8u);
}

fn item(i: u32) {
    let per_row = prm.K / 8u;
    let h = w_vec8(i / per_row, (i % per_row) * 8u, prm.K);
    let lo = vec4<f32>(h.lo);   // f16 -> f32 -> f16 is exact (naga has no f16 vector bitcasts)
    let hi = vec4<f32>(h.hi);
    O[i] = vec4<u32>(pack2x16float(lo.xy), pack2x16float(lo.zw), pack2x16float(hi.xy), pack2x16float(hi.zw));
}
