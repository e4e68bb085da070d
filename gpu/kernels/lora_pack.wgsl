// The integer GEMM's LoRA operands as f16 (gpu/ops/matmul_i8.py lora_term; per-item skeleton threads.wgsl after
// this file): two copies in one dispatch, each of an f32 matrix src [rows, cols] (row-major) into an f16 matrix
// dst [rows_p, cols_p] times a factor, zero outside src: items 0 .. n0 fill T16 from T (at element offsets t16_off
// and t_off), the next n1 L16 from L.
enable f16;

struct PackParams {
    n0: u32,       // items of the first copy: rows0 * cols0_p
    rows0: u32,
    cols0: u32,
    cols0_p: u32,
    factor0: f32,
    n1: u32,       // items of the second copy: rows1_p * cols1_p
    rows1: u32,
    cols1: u32,
    cols1_p: u32,
    factor1: f32,
    t_off: u32,    // the first copy's source and destination offsets (elements)
    t16_off: u32,
};

@group(0) @binding(0) var<uniform> prm: PackParams;
@group(0) @binding(1) var<storage, read> T: array<f32>;
@group(0) @binding(2) var<storage, read> L: array<f32>;
@group(0) @binding(3) var<storage, read_write> T16: array<f16>;
@group(0) @binding(4) var<storage, read_write> L16: array<f16>;

const WG: u32 = 256u;

fn n_items() -> u32 {
    return prm.n0 + prm.n1;
}

fn item(i: u32) {
    if (i < prm.n0) {
        let row = i / prm.cols0_p;
        let col = i % prm.cols0_p;
        let x = T[prm.t_off + row * prm.cols0 + min(col, prm.cols0 - 1u)];
        T16[prm.t16_off + i] = f16(select(0.0, x * prm.factor0, col < prm.cols0));
        return;
    }
    let j = i - prm.n0;
    let row = j / prm.cols1_p;
    let col = j % prm.cols1_p;
    let inside = row < prm.rows1 && col < prm.cols1;
    L16[j] = f16(select(0.0, L[min(row * prm.cols1 + col, prm.rows1 * prm.cols1 - 1u)] * prm.factor1, inside));
}
