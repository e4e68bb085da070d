// The thin operand of LoRA's gradient products on the integer tensor cores (gpu/ops/lora_db_i8.py dB = s dY^T t,
// gpu/ops/lora_da_i8.py dA = dt^T x): u[m, n] = RS[m] S_n[m] (the large operand's row scales, which its codes leave
// out, times column n of the f32 operand) rounded to 8 bits of its max over each chunk of rows, a scale per chunk and
// column: workgroup i = z N + n takes column n over rows z chunk .. (z + 1) chunk, its codes stored by columns (Q:
// row n of M codes, packed four per word: lora_sum_i8.wgsl's R) and its scale at CS[i] (int8_pack.wgsl rounds). The
// N columns are those of up to four row-major [M, cols] blocks of S (the dt's of adapters sharing an input), block
// n / cols at float offs[n / cols].

struct Params {
    M: u32,        // rows (a multiple of chunk)
    N: u32,        // columns
    chunk: u32,    // rows per scale (a multiple of 4)
    cols: u32,     // columns per block of S
    offs: vec4<u32>,  // each block's first float in S
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> S: array<f32>;
@group(0) @binding(2) var<storage, read> RS: array<f32>;
@group(0) @binding(3) var<storage, read_write> Q: array<u32>;
@group(0) @binding(4) var<storage, read_write> CS: array<f32>;

const WG: u32 = 64u;

fn value(m: u32, n: u32) -> f32 {
    return RS[m] * S[prm.offs[n / prm.cols] + m * prm.cols + n % prm.cols];
}

// rows m .. m + 3 of column n
fn four(m: u32, n: u32) -> vec4<f32> {
    return vec4<f32>(value(m, n), value(m + 1u, n), value(m + 2u, n), value(m + 3u, n));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = wid.x + wid.y * nwg.x;
    if (i >= (prm.M / prm.chunk) * prm.N) {   // uniform: the workgroup's own column chunk
        return;
    }
    let n = i % prm.N;
    let m0 = (i / prm.N) * prm.chunk;
    let words = prm.chunk / 4u;
    var mx = 0.0;
    for (var w = lid; w < words; w += WG) {
        mx = max(mx, absmax4(four(m0 + 4u * w, n)));
    }
    let scale = workgroup_reduce(lid, mx) / 127.0;
    for (var w = lid; w < words; w += WG) {
        Q[(n * prm.M + m0) / 4u + w] = pack4(four(m0 + 4u * w, n), scale);
    }
    if (lid == 0u) {
        CS[i] = scale;
    }
}
