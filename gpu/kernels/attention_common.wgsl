// Shared by the attention kernels (prepended by gpu/ops/attention.py): uniform params and tile constants.
// Q, O: [T, HQ, D]; K, V: [T, HKV, D] as D/4 vec4 rows; query head h reads kv head h / (HQ / HKV).

struct Params {
    T: u32,
    HQ: u32,
    HKV: u32,
    scale: f32,
};

const DV: u32 = ${DV}u;   // head_dim / 4
const BQ: u32 = ${BQ}u;   // rows per workgroup (one thread each)
const BK: u32 = ${BK}u;   // rows per staged tile
const NEG_BIG: f32 = -3.0e38;
