// The right operand of dt = s dY B on LoRA's integer thin product (gpu/ops/lora_i8.py LoraGradCodes): the input
// gradient's integer GEMM takes dY times its weight's row scales sW, rounded per row, so dt = s sum_o (dY sW)[m, o]
// (B / sW)[o, n]. Table row i (one workgroup): Rows[i] = (the element of B[0, n] in P, the first of the
// projection's sW in SW, d_out, the first code word in Q); the row's values B[o, n] / sW[o] (B's rows r floats
// apart; 0 where sW is 0: that column of dY's codes is 0) rounded to 8 bits of their max (int8_pack.wgsl), and
// its scale times the LoRA scale s at S[i].

struct Params {
    rows: u32,      // table rows
    r: u32,         // B's row length (the rank)
    factor: f32,    // the LoRA scale s
    _pad0: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<f32>;
@group(0) @binding(2) var<storage, read> SW: array<f32>;
@group(0) @binding(3) var<storage, read_write> Q: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<f32>;
@group(0) @binding(5) var<storage, read> Rows: array<vec4<u32>>;

const WG: u32 = 256u;

fn value(e: vec4<u32>, o: u32) -> f32 {
    let sw = SW[e.y + o];
    return select(0.0, P[e.x + o * prm.r] / sw, sw > 0.0);
}

fn group4(e: vec4<u32>, w: u32) -> vec4<f32> {
    let o = 4u * w;
    return vec4<f32>(value(e, o), value(e, o + 1u), value(e, o + 2u), value(e, o + 3u));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = wid.x + wid.y * nwg.x;
    if (i >= prm.rows) {   // uniform: the workgroup's own row
        return;
    }
    let e = Rows[i];
    let words = e.z / 4u;
    var m = 0.0;
    for (var w = lid; w < words; w += WG) {
        m = max(m, absmax4(group4(e, w)));
    }
    let scale = workgroup_reduce(lid, m) / 127.0;
    for (var w = lid; w < words; w += WG) {
        Q[e.w + w] = pack4(group4(e, w), scale);
    }
    if (lid == 0u) {
        S[i] = scale * prm.factor;
    }
}
