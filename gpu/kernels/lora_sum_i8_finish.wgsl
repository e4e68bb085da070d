// The second pass of LoRA's integer gradient products over rows (gpu/ops/lora_db_i8.py, lora_da_i8.py): output
// (i, n) is s = sum_z CS[z N + n] P[z, i, n], each chunk's i32 sum times its column scale, added in ascending z (f32).
// ${OUTPUT_NOTE} One thread per output.

struct Params {
    count: u32,       // D * N
    N: u32,
    splits: u32,
    c_off: u32,       // C's first float (rows variant)
    rf_off: u32,      // the first row factor in RF (rows variant)
    accumulate: u32,
    factor: f32,
    cols: u32,        // columns per output block (cols variant)
    offs: vec4<u32>,  // each output block's first float in C (cols variant)
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<i32>;
@group(0) @binding(2) var<storage, read> CS: array<f32>;
${BINDINGS}

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
${OUTPUT}
    if (prm.accumulate != 0u) {
        v += C[at];
    }
    C[at] = v;
}
