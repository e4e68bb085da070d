// The second pass of LoRA's integer gradient product over rows (gpu/ops/lora_db_i8.py): C[i, n] (+)= factor / RF[i]
// sum_z CS[z N + n] P[z, i, n], each chunk's i32 sum times its column scale, added in ascending z (f32), over the
// output row's divisor (dB: the weight row scale sW[o] that dY's codes carry; 0 where it is 0) into C[c_off + i N +
// n] (row-major, rows of N). One thread per output.

struct Params {
    count: u32,       // D * N
    N: u32,
    splits: u32,
    c_off: u32,       // C's first float
    rf_off: u32,      // the first row factor in RF
    accumulate: u32,
    factor: f32,
    _pad0: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<i32>;
@group(0) @binding(2) var<storage, read> CS: array<f32>;
@group(0) @binding(3) var<storage, read> RF: array<f32>;
@group(0) @binding(4) var<storage, read_write> C: array<f32>;

const WG: u32 = 256u;  // one thread per output (threads.wgsl)

fn n_items() -> u32 {
    return prm.count;
}

fn item(e: u32) {
    let n = e % prm.N;
    var s = 0.0;
    for (var z = 0u; z < prm.splits; z++) {
        s += f32(P[z * prm.count + e]) * CS[z * prm.N + n];
    }
    let rf = RF[prm.rf_off + e / prm.N];
    var v = select(0.0, prm.factor / rf, rf > 0.0) * s;
    if (prm.accumulate != 0u) {
        v += C[prm.c_off + e];
    }
    C[prm.c_off + e] = v;
}
