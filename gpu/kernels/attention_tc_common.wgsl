// Shared by the tensor-core attention kernels (gpu/codegen_attention_tc.py prepends it): directives, params,
// tile constants. A workgroup of NSG subgroups (32 invocations each) owns BR = 16 NSG rows (queries, or keys
// in the dK/dV pass), 16 per subgroup, whose left matrices it stages once from the packed f16 copies
// (pack_f16.wgsl: [T_pad, heads, D], rows past T zero). The other operand streams through
// workgroup memory BC rows at a time, staged in blocks of 16 rows (one array each), and each subgroup has
// its own score / probability arrays, so every matrix load in the loop has a literal offset (Tint's
// robustness then adds no predicate to it). Matrix results are opaque: a softmax step stores them to
// workgroup memory, where invocation `lane` of the subgroup handles row lane & 15 and the column pairs
// 4m + 2 (lane >> 4) + {0, 1} (m = 0 .. BC/4 - 1): each 32-bit word of an f16 block is written by one
// invocation, and the f32 reads stay at 2-way bank conflicts.
diagnostic(off, chromium.subgroup_matrix_uniformity);
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;

// A dispatch covers a batch of sequences (wid.z = z): rows z T .. of the f32 tensors [B T, heads, D], rows
// z TP .. of the packed f16 operands [B TP, heads, D], floats z LS .. of L, (z HQ + h) T + i of delta.
struct Params {
    T: u32,
    HQ: u32,
    HKV: u32,
    scale: f32,
    TP: u32,      // rows per sequence of the packed f16 operands (T rounded up, plus zero padding rows)
    LS: u32,      // floats per sequence of L (>= HQ T)
};

const D: u32 = ${D}u;           // head_dim
const BC: u32 = ${BC}u;         // columns (keys, or queries in the dK/dV pass) per tile
const NSG: u32 = ${NSG}u;       // subgroups per workgroup
const BR: u32 = NSG * 16u;      // rows per workgroup
const THREADS: u32 = NSG * 32u;
const NB: u32 = BC / 16u;       // 16-row blocks of a staged tile
const LDH: u32 = D + 8u;        // f16 row stride of a staged [16][D] block (16-byte rows)
const LDS: u32 = BC + 4u;       // f32 row stride of a [16][BC] score block (16-byte rows)
const LDP: u32 = BC + 8u;       // f16 row stride of a [16][BC] probability block (16-byte rows)
const NEG_BIG: f32 = -3.0e38;

// grad_scale (grad_scale.wgsl, appended by gpu/codegen_attention_tc.py): the dO scale sigma from the bits of
// max |dO| (attention_tc_delta.wgsl).
