// The shared part of LoRA's bandwidth paths (lora_stream.wgsl, lora_rows.wgsl; gpu/ops/lora_matmul.py): their
// parameters, bindings and output. C(m, n) (+)= alpha * sum_k A(m, k) S(k, n) over k in split z's chunk; A and S
// are read as vec4s (every offset and stride a multiple of 4 elements, M a multiple of 4). S's columns in blocks of
// 16 (grid x); with column groups (gw > 0, a multiple of 16) block n0 lies in group n0 / gw, whose S starts b_go
// and whose C starts c_go elements further. Output as lora_gemm.wgsl's: split partials at P[(z M + m) N + n] for
// lora_reduce.wgsl, else C[c_off + c_go + m csm + (n % gw) csn] = alpha * sum (+ its old value if accumulate).

struct Params {
    M: u32,
    N: u32,
    K: u32,
    chunk: u32,      // reduction steps per split
    a_off: u32,
    lda: u32,        // A's stride along its strided axis
    b_off: u32,
    ldb: u32,        // S's stride along its strided axis
    c_off: u32,
    csm: u32,
    csn: u32,
    alpha: f32,
    accumulate: u32,
    partial: u32,
    gw: u32,
    _pad0: u32,
    b_go: vec4<u32>,
    c_go: vec4<u32>,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> A: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> B: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

// S's first element of column block n0 (its group's offset added) and that column's index within its group
fn s_base(n0: u32) -> vec2<u32> {
    if (prm.gw == 0u) {
        return vec2<u32>(prm.b_off, n0);
    }
    return vec2<u32>(prm.b_off + prm.b_go[n0 / prm.gw], n0 % prm.gw);
}

fn put_out(m: u32, n: u32, z: u32, v: f32) {
    if (m >= prm.M || n >= prm.N) {
        return;
    }
    if (prm.partial != 0u) {
        C[(z * prm.M + m) * prm.N + n] = v;
        return;
    }
    var go = 0u;
    var col = n;
    if (prm.gw != 0u) {
        go = prm.c_go[n / prm.gw];
        col = n % prm.gw;
    }
    let i = prm.c_off + go + m * prm.csm + col * prm.csn;
    var r = prm.alpha * v;
    if (prm.accumulate != 0u) {
        r += C[i];
    }
    C[i] = r;
}

fn put_out4(m: u32, n: u32, z: u32, v: vec4<f32>) {
    put_out(m, n, z, v.x);
    put_out(m, n + 1u, z, v.y);
    put_out(m, n + 2u, z, v.z);
    put_out(m, n + 3u, z, v.w);
}
