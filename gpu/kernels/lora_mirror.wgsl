// f16 mirrors of the LoRA parameters for the integer GEMM's LoRA epilogue (gpu/ops/lora_mirror.py), refreshed in
// one dispatch per rotation block: row r of the table Rows copies units = Rows[r].z vec4s of the f32 parameters P
// from vec4 Rows[r].x to vec4 Rows[r].y of Y16, rounded to f16 as lora_pack.wgsl rounds them; where Rows[r].w > 0
// rotated as the integer GEMM's operands (hadamard.wgsl, blocks of ROT; the row's first column is column
// Rows[r].w - 1 of the matrix row: a LoRA A rotated like the weight codes it meets, as hadamard_rows "forward"
// rotates it). A workgroup per table row (rows_rotated.wgsl), PER groups of four per invocation at most.
enable f16;

struct Params {
    T: u32,   // table rows
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> P: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> Rows: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> Y16: array<vec4<f16>>;

const WG: u32 = 256u;
const PER: u32 = 16u;

var<workgroup> row_entry: vec4<u32>;

fn row_main(r: u32, lid: u32) {
    if (lid == 0u) {
        row_entry = Rows[r];
    }
    let e = workgroupUniformLoad(&row_entry);
    let shuffled = rotation_shuffled(lid, ROT / 4u);
    for (var j = 0u; j < PER; j++) {
        let w = lid + j * WG;
        if (j * WG < e.z) {   // uniform
            var x = vec4<f32>();
            if (w < e.z) {
                x = P[e.x + w];
            }
            var y = x;
            if (e.w > 0u) {   // uniform
                let col = e.w - 1u + 4u * w;
                if (shuffled) {
                    y = rotate_group_shuffled(lid, x, col, false);
                } else {
                    y = rotate_group_shared(lid, x, col, false);
                }
            }
            if (w < e.z) {
                Y16[e.y + w] = vec4<f16>(y);
            }
        }
    }
}
