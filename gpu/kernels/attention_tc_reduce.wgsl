// dK, dV [T, HKV, D] = the sums of the per-query-head results [T, HQ, D] of attention_tc_backward_dkv over
// each kv head's group of HQ / HKV query heads, in ascending head order (deterministic, no atomics).

struct ReduceParams {
    n: u32,       // T * HKV * D / 4 output units
    ratio: u32,   // HQ / HKV
    dv: u32,      // D / 4
};

@group(0) @binding(0) var<uniform> prm: ReduceParams;
@group(0) @binding(1) var<storage, read> dKh: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> dVh: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> dK: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> dV: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let u = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (u >= prm.n) {
        return;
    }
    let row = u / prm.dv;   // t * HKV + g
    let src = (row * prm.ratio) * prm.dv + u % prm.dv;   // (t * HQ + g * ratio) * D / 4 + d
    var k = vec4<f32>(0.0);
    var v = vec4<f32>(0.0);
    for (var hh = 0u; hh < prm.ratio; hh++) {
        k += dKh[src + hh * prm.dv];
        v += dVh[src + hh * prm.dv];
    }
    dK[u] = k;
    dV[u] = v;
}
