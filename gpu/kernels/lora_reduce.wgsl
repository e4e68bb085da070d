// The second pass of a split lora_gemm (gpu/ops/lora_matmul.py): C(m, n) = alpha * sum_z P[z, m, n]
// (+ C(m, n) if accumulate), the splits added in ascending z (deterministic, no atomics);
// C(m, n) = C[c_off + m * csm + n * csn]. One thread per output.

struct Params {
    count: u32,   // M * N
    N: u32,
    splits: u32,
    c_off: u32,
    csm: u32,
    csn: u32,
    alpha: f32,
    accumulate: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<f32>;
@group(0) @binding(2) var<storage, read_write> C: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (e >= prm.count) {
        return;
    }
    var s = 0.0;
    for (var z = 0u; z < prm.splits; z++) {
        s += P[z * prm.count + e];
    }
    let i = prm.c_off + (e / prm.N) * prm.csm + (e % prm.N) * prm.csn;
    var r = prm.alpha * s;
    if (prm.accumulate != 0u) {
        r += C[i];
    }
    C[i] = r;
}
