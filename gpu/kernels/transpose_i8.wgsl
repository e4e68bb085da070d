// int8 codes transposed: QT [K rows, N] from Q [N rows, K] (four codes per u32 word, little-endian; N and K
// multiples of 4), QT[k, n] = Q[n, k]. The input gradient then runs on the forward's ("nt") integer GEMM, whose
// staging reads whole rows, instead of transposing W tile by tile in every workgroup of the "nn" GEMM.
// A workgroup per 64 x 64 tile (wid.x along K, wid.y along N): 64 rows of 16 words through workgroup memory.

@group(0) @binding(0) var<uniform> prm: vec4<u32>;   // (N rows of Q, K codes per row, -, -)
@group(0) @binding(1) var<storage, read> Q: array<u32>;
@group(0) @binding(2) var<storage, read_write> QT: array<u32>;

const WG: u32 = 256u;
const LD: u32 = 17u;  // words per staged row (16 + 1 against bank conflicts)
var<workgroup> tile: array<u32, 1088>;  // 64 rows x LD

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_rows = prm.x;
    let k_codes = prm.y;
    let kw = k_codes / 4u;
    let nw = n_rows / 4u;
    let w = lid % 16u;
    for (var e = 0u; e < 4u; e++) {
        let row = e * 16u + lid / 16u;
        let n = wid.y * 64u + row;
        let word = wid.x * 16u + w;
        var v = 0u;
        if (n < n_rows && word < kw) {
            v = Q[n * kw + word];
        }
        tile[row * LD + w] = v;
    }
    workgroupBarrier();
    for (var e = 0u; e < 4u; e++) {
        let r = e * 16u + lid / 16u;  // QT's row k = wid.x * 64 + r, its word w holds n = wid.y * 64 + 4w .. 4w + 3
        let k = wid.x * 64u + r;
        let word = wid.y * 16u + w;
        let shift = 8u * (r % 4u);
        var out = 0u;
        for (var b = 0u; b < 4u; b++) {
            out |= ((tile[(4u * w + b) * LD + r / 4u] >> shift) & 0xffu) << (8u * b);
        }
        if (k < k_codes && word < nw) {
            QT[k * nw + word] = out;
        }
    }
}
