// Each row's RoPE (cos, sin) pairs (gpu/ops/rope.py rope_rows; per-item skeleton threads.wgsl after this file):
// R[row, j] = CS[min(positions[row], n_pos - 1), j] for j < D / 2, the table's pairs at the row's position, for
// the integer GEMM that writes attention's RoPE'd f16 operands (matmul_i8.wgsl's "rope" output).

struct Params {
    rows: u32,
    half: u32,    // pairs per row (D / 2)
    n_pos: u32,   // table rows
    _pad0: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read_write> R: array<vec2<f32>>;

const WG: u32 = 256u;

fn n_items() -> u32 {
    return prm.rows * prm.half;
}

fn item(i: u32) {
    let row = i / prm.half;
    R[i] = CS[min(positions[row], prm.n_pos - 1u) * prm.half + i % prm.half];
}
