// Emulation of the int8 subgroup-matrix builtins in plain WGSL (gpu/codegen_i8.py, emulate=True), to test the
// generated kernel's indexing on adapters without subgroup matrices (lavapipe). An operand is its load
// descriptor (the staged tile stays in workgroup memory until the next barrier); a result is distributed as
// 8 elements per invocation of its logical subgroup (lane * 8 .. lane * 8 + 7, row-major). Codes are bytes
// of the i32 words, element [row][col] at off + stride * row + col (row-major) or off + stride * col + row.
var<private> emu_lane: u32;

struct EmuOp {
    blk: u32,
    off: u32,
    col_major: u32,
    stride: u32,
}

struct EmuI {
    v: array<i32, 8>,
}

fn emu_index(off: u32, row: u32, col: u32, col_major: u32, stride: u32) -> u32 {
    return select(off + stride * row + col, off + stride * col + row, col_major != 0u);
}

fn emu_byte(word: i32, i: u32) -> i32 {
    return (word << (24u - 8u * (i % 4u))) >> 24u;   // sign-extending
}

fn emu_mma(a: EmuOp, b: EmuOp, acc: EmuI) -> EmuI {
    var out = acc;
    for (var e = 0u; e < 8u; e++) {
        let row = (emu_lane * 8u + e) / 16u;
        let col = (emu_lane * 8u + e) % 16u;
        var s = out.v[e];
        for (var k = 0u; k < 32u; k++) {
            let ia = emu_index(a.off, row, k, a.col_major, a.stride);
            let ib = emu_index(b.off, k, col, b.col_major, b.stride);
            s += emu_byte(As[a.blk][ia / 4u], ia) * emu_byte(Bs[b.blk][ib / 4u], ib);
        }
        out.v[e] = s;
    }
    return out;
}

fn emu_store_cs(sg: u32, off: u32, m: EmuI) {
    for (var e = 0u; e < 8u; e++) {
        ${CS_ARR}[${CS_BASE}off + emu_lane * 8u + e] = m.v[e];
    }
}
