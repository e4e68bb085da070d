// Shared by the attention kernels (prepended by gpu/ops/attention.py): uniform params, tile constants, the mask.
// Q, O: [T, HQ, D]; K, V: [T, HKV, D] as D/4 vec4 rows; query head h reads kv head h / (HQ / HKV).

struct Params {
    T: u32,
    HQ: u32,
    HKV: u32,
    scale: f32,
    window: u32,   // sliding window: query i sees keys j with i - W < j <= i; 0 = every j <= i
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
};

const DV: u32 = ${DV}u;   // head_dim / 4
const BQ: u32 = ${BQ}u;   // rows per workgroup (one thread each)
const BK: u32 = ${BK}u;   // rows per staged tile
const NEG_BIG: f32 = -3.0e38;

// Key j is hidden from query i: after it (causal), or W or more positions before it (sliding window W > 0).
fn masked(i: u32, j: u32) -> bool {
    return j > i || (prm.window > 0u && j + prm.window <= i);
}

// The first key tile a block of queries i0 .. i0+BQ-1 needs: 0, or with a window the tile of key i0 + 1 - W.
fn first_key_tile(i0: u32) -> u32 {
    if (prm.window == 0u || i0 + 1u <= prm.window) {
        return 0u;
    }
    return (i0 + 1u - prm.window) / BK;
}
