// Activations to int8 for the integer GEMM (model/int8.py quantize_i8 is the numpy twin): per row r and chunk c of
// `chunk` consecutive elements, S[r, c] = max |X[r, chunk c]| / 127 and Q[r, k] = round(X[r, k] / S[r, c])
// (ties to even, |q| <= 127; an all-zero chunk gives S = 0 and codes 0), four codes per u32 word, little-endian.
// A workgroup per (chunk, per_wg rows, one after the other): each chunk's values held in registers for its absmax
// (workgroup_reduce.wgsl) and its codes (int8_codes.wgsl codes_of_row; or, rotated, int8_units.wgsl
// rotated_unit_codes: units of 16 values, Q as vec4s). VEC4: X (and CS) read as vec4 (offsets and strides multiples
// of 4). Variant table (one chunk a row): row r of X starts at element Rows[r].x, its codes at vec4 Rows[r].y of Q
// and its scale at Rows[r].z of S (rows gathered from anywhere: every LoRA A of one rotation, gpu/ops/lora_i8.py).

struct Params {
    k: u32,        // row length (codes per row of Q)
    ldx: u32,      // row stride of X in elements
    x_off: u32,    // first element of X
    chunk: u32,    // elements per scale (multiple of 4)
    chunks: u32,   // k / chunk
    rows: u32,     // rows of X
    per_wg: u32,   // rows a workgroup takes, one after the other (the column scales then read once per row group)
    _pad2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<${X_ELEM}>;
@group(0) @binding(2) var<storage, read_write> Q: array<${Q_ELEM}>;
@group(0) @binding(3) var<storage, read_write> S: array<f32>;
${CS_BINDING}
${TABLE_BINDING}
const ABSMAX: bool = true;   // activations: every scale from its absmax (int8_codes.wgsl)
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, m) / 127.0;
}

var<private> x0: u32;   // X's index of this workgroup's chunk start
var<private> k0: u32;   // its column

// values 4w .. 4w + 3 of this workgroup's chunk (times CS when scaled)
fn group4(w: u32) -> vec4<f32> {
${GROUP4}
}
${UNIT_VALUES}
const WG: u32 = ${WG}u;   // invocations a row (256, or 64 for rows of <= 4096: gpu/ops/quantize_i8.py)
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let c = wid.x;
    for (var i = 0u; i < prm.per_wg; i++) {
        let r = wid.y * prm.per_wg + i;
        if (r >= prm.rows) {   // uniform: the workgroup's rows end together
            break;
        }
        if (i > 0u) {
            workgroupBarrier();   // the last row's reduction read by every invocation before this row's
        }
        x0 = ${ROW_X0};
        k0 = c * prm.chunk;
        let scale = ${CODES};
        if (lid == 0u) {
            S[${ROW_S}] = scale;
        }
    }
}
