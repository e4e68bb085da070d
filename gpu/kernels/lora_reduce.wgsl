${ENABLE_F16}
// The second pass of a split lora_gemm (gpu/ops/lora_matmul.py): C(m, n) = alpha * sum_z P[z, m, n]
// (+ C(m, n) if accumulate), the splits added in ascending z (deterministic, no atomics);
// C(m, n) = C[c_off + m * csm + n * csn]. One thread per output; eight partials loaded at a time (all in flight)
// before they are added in order. Variant half: each result also as f16 times h_factor, at
// T16[h_off + h_go[group] + m * h_ld + n] (the integer GEMM's LoRA operand t16, gpu/ops/lora_matmul.py HalfCopy).

struct Params {
    count: u32,   // M * N
    N: u32,
    splits: u32,
    c_off: u32,
    csm: u32,
    csn: u32,
    alpha: f32,
    accumulate: u32,
    gw: u32,          // column groups as lora_gemm.wgsl's (0: none)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    c_go: vec4<u32>,
    h_off: u32,       // variant half: the f16 copy's offset, row length and factor, and per group its offset
    h_ld: u32,
    h_factor: f32,
    _pad3: u32,
    h_go: vec4<u32>,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<f32>;
@group(0) @binding(2) var<storage, read_write> C: array<f32>;
${T16_BINDING}

const WG: u32 = 256u;  // one thread per output (threads.wgsl)

fn n_items() -> u32 {
    return prm.count;
}

fn item(e: u32) {
    let n = prm.count;
    var s = 0.0;
    var z = 0u;
    for (; z + 8u <= prm.splits; z += 8u) {
        let i = z * n + e;
        let p0 = P[i];
        let p1 = P[i + n];
        let p2 = P[i + 2u * n];
        let p3 = P[i + 3u * n];
        let p4 = P[i + 4u * n];
        let p5 = P[i + 5u * n];
        let p6 = P[i + 6u * n];
        let p7 = P[i + 7u * n];
        s = s + p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7;
    }
    for (; z < prm.splits; z++) {
        s += P[z * n + e];
    }
    var col = e % prm.N;
    var go = 0u;
    var g = 0u;
    if (prm.gw != 0u) {
        g = col / prm.gw;
        go = prm.c_go[g];
        col = col % prm.gw;
    }
    let i = prm.c_off + go + (e / prm.N) * prm.csm + col * prm.csn;
    var r = prm.alpha * s;
    if (prm.accumulate != 0u) {
        r += C[i];
    }
    C[i] = r;
    ${T16_STORE}
}
