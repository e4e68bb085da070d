// LoRA backward's two products over dY in one pass (gpu/ops/lora_dual.py), rank 16: per workgroup a chunk of
// CR token rows x TC columns of dY, read once from memory in steps of TR rows, gives
//   the chunk's share of dB (its TC columns' [TC, 16] sums over its CR rows, dB = dY^T t), and
//   each step's share of dt (its TR rows' [TR, 16] sums over its TC columns, dt = dY B),
// as partial sums lora_reduce.wgsl adds up in ascending order (deterministic, no atomics): dt's at P[dt part, row,
// j] (one part per column tile), dB's from P[prm.db0] at [row chunk, column, j]. dY [T, N], t [T, 16], B [N, 16]
// row-major. Invocation lid owns column lid of the tile for dB (16 sums in registers) and, for dt, row lid / 16,
// ranks 4 ((lid / 4) % 4) .. + 3 over every fourth column from lid % 4 (its quarter's sums added through Red).

struct Params {
    T: u32,
    N: u32,
    db0: u32,   // first float of dB's partials in P
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> DY: array<f32>;
@group(0) @binding(2) var<storage, read> TT: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> BB: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> P: array<f32>;

const R: u32 = 16u;
const TC: u32 = 256u;      // columns of a tile: one per invocation
const TR: u32 = 16u;       // rows a step
const CR: u32 = ${CR}u;    // rows a workgroup
const LDY: u32 = TC + 4u;  // padded row stride of Ys (the dt reads of 8 rows x quarters fall in distinct banks)
var<workgroup> Ys: array<f32, TR * LDY>;           // the step's rows of dY
var<workgroup> Bs: array<vec4<f32>, TC * 4u>;      // B's rows of the tile: Bs[4 c + q] = B[c0 + c, 4 q .. 4 q + 3]
var<workgroup> Ts: array<vec4<f32>, TR * 4u>;      // t's rows of the step, likewise
var<workgroup> Red: array<vec4<f32>, 4u * TR * 4u>;  // dt's quarter sums: [quarter][row][rank / 4]

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c0 = wid.x * TC;
    let r0 = wid.y * CR;
    let col = c0 + lid;
    for (var q = 0u; q < 4u; q++) {
        Bs[lid * 4u + q] = select(vec4<f32>(0.0), BB[min(col, prm.N - 1u) * 4u + q], col < prm.N);
    }
    var db0 = vec4<f32>(0.0);
    var db1 = vec4<f32>(0.0);
    var db2 = vec4<f32>(0.0);
    var db3 = vec4<f32>(0.0);
    let dt_row = lid / 16u;
    let dt_q = (lid / 4u) % 4u;
    let quarter = lid % 4u;
    for (var s = 0u; s < CR / TR; s++) {
        let rs = r0 + s * TR;
        workgroupBarrier();
        for (var k = 0u; k < TR; k++) {
            let row = rs + k;
            let y = DY[min(row, prm.T - 1u) * prm.N + min(col, prm.N - 1u)];
            Ys[k * LDY + lid] = select(0.0, y, row < prm.T && col < prm.N);
        }
        if (lid < TR * 4u) {
            let row = rs + lid / 4u;
            Ts[lid] = select(vec4<f32>(0.0), TT[min(row, prm.T - 1u) * 4u + lid % 4u], row < prm.T);
        }
        workgroupBarrier();
        for (var k = 0u; k < TR; k++) {   // dB: this column's sums over the step's rows
            let y = Ys[k * LDY + lid];
            db0 += y * Ts[k * 4u];
            db1 += y * Ts[k * 4u + 1u];
            db2 += y * Ts[k * 4u + 2u];
            db3 += y * Ts[k * 4u + 3u];
        }
        var acc = vec4<f32>(0.0);   // dt: this row's 4 ranks over this quarter's columns
        for (var c = quarter; c < TC; c += 4u) {
            acc += Ys[dt_row * LDY + c] * Bs[c * 4u + dt_q];
        }
        Red[(quarter * TR + dt_row) * 4u + dt_q] = acc;
        workgroupBarrier();
        let row = rs + lid / 16u;
        let j = lid % 16u;
        if (row < prm.T) {
            var sum = 0.0;
            for (var qq = 0u; qq < 4u; qq++) {
                sum += Red[(qq * TR + lid / 16u) * 4u + j / 4u][j % 4u];
            }
            P[(wid.x * prm.T + row) * R + j] = sum;
        }
    }
    if (col < prm.N) {
        let o = prm.db0 + (wid.y * prm.N + col) * R;
        let sums = array<vec4<f32>, 4>(db0, db1, db2, db3);
        for (var q = 0u; q < 4u; q++) {
            for (var e = 0u; e < 4u; e++) {
                P[o + 4u * q + e] = sums[q][e];
            }
        }
    }
}
