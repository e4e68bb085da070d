// LoRA term of the integer GEMM's epilogue (include of matmul_i8.wgsl, its LoRA variants): each result matrix's
// block of T16 . L is computed on the f16 tensor cores into the subgroup's scratch Ls, beside the integer block in
// Cs, and each invocation adds its 8 values to the scaled integer ones as they are written (M and N multiples of
// 16; gpu/ops/lora.py lora_term packs the operands). T16 [M, LR] f16 row-major (the LoRA scale folded in, ranks
// past r zero: LR = r rounded up to 16); L16 holds L [LR, N] as L^T [N, LR] ("rows": the forward's B) or as L
// itself ("cols": the input gradient's A).
@group(0) @binding(6) var<storage, read> T16: array<f16>;
@group(0) @binding(7) var<storage, read> L16: array<f16>;
var<workgroup> Ls: array<array<f32, ${LS_LEN}>, NSG>;   // FM LoRA blocks per subgroup, laid out as Cs

// Ls[sg][f 256 ..] = T16[mb .. mb + 16, :] . L[:, nb .. nb + 16] (one subgroup; uniform mb, nb inside M, N)
${LORA_BLOCK}

// this invocation's 8 values of the subgroup's LoRA block f (as scaled8 reads Cs)
fn lora8(sg: u32, f: u32, lane: u32) -> array<f32, 8> {
    var v: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        v[e] = Ls[sg][f * 256u + e * 32u + lane];
    }
    return v;
}
