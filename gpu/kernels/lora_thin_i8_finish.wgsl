${ENABLE_F16}
// The second pass of LoRA's integer thin product (gpu/ops/lora_i8.py): t(m, n) = SX[m] SA_n sum_z P[z, m, n],
// the chunks' i32 sums added in ascending z (exact), times x's row scale and A's row scale (column n: row n % r of
// the A of group n / r, its scales at s_go[group]), to T[t_go[group] + m r + n % r]. Variant half: also
// f16(h_factor t) at T16[h_go[group] + m r + n % r] (the integer GEMM's LoRA operand t16). One thread per output.

struct Params {
    count: u32,    // M * N
    N: u32,
    splits: u32,
    r: u32,
    MP: u32,       // rows of P per chunk
    sx_off: u32,   // x's first row scale in SX
    h_factor: f32,
    _pad0: u32,
    s_go: vec4<u32>,   // per group: its A's first row scale in SA
    t_go: vec4<u32>,   // per group: its t's first float in T
    h_go: vec4<u32>,   // per group: its t16's first half in T16 (variant half)
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<i32>;
@group(0) @binding(2) var<storage, read> SX: array<f32>;
@group(0) @binding(3) var<storage, read> SA: array<f32>;
@group(0) @binding(4) var<storage, read_write> T: array<f32>;
${T16_BINDING}

const WG: u32 = 256u;  // one thread per output (threads.wgsl)

fn n_items() -> u32 {
    return prm.count;
}

fn item(e: u32) {
    let m = e / prm.N;
    let n = e % prm.N;
    let stride = prm.MP * prm.N;
    let first = m * prm.N + n;
    var s = 0;
    for (var z = 0u; z < prm.splits; z++) {
        s += P[z * stride + first];
    }
    let g = n / prm.r;
    let c = n % prm.r;
    let t = f32(s) * SX[prm.sx_off + m] * SA[prm.s_go[g] + c];
    T[prm.t_go[g] + m * prm.r + c] = t;
    ${T16_STORE}
}
