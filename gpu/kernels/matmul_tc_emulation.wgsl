// Emulation of the subgroup-matrix builtins in plain WGSL (gpu/codegen_tc.py, emulate=True), to test the
// generated kernel's indexing on adapters without subgroup matrices (lavapipe). A left/right operand is
// only its load descriptor (the tile it names stays in workgroup memory until the next barrier); a result
// is distributed like the real thing: invocation `lane` of its logical subgroup (32 consecutive
// invocations) holds elements lane * 8 .. lane * 8 + 7 (row-major). Element [row][col] maps to memory as
// the extension defines: row-major off + stride * row + col, column-major off + stride * col + row.
var<private> emu_lane: u32;

struct EmuH {
    blk: u32,
    off: u32,
    col_major: u32,
    stride: u32,
}

struct EmuF {
    v: array<f32, 8>,
}

// naga has no width-changing bitcast to f16 vectors
fn emu_h2(q: u32) -> vec2<f16> {
    return vec2<f16>(unpack2x16float(q));
}

fn emu_h4(q: vec2<u32>) -> vec4<f16> {
    return vec4<f16>(emu_h2(q.x), emu_h2(q.y));
}

fn emu_index(off: u32, row: u32, col: u32, col_major: u32, stride: u32) -> u32 {
    return select(off + stride * row + col, off + stride * col + row, col_major != 0u);
}

fn emu_mma(a: EmuH, b: EmuH, acc: EmuF) -> EmuF {
    var out = acc;
    for (var e = 0u; e < 8u; e++) {
        let row = (emu_lane * 8u + e) / 16u;
        let col = (emu_lane * 8u + e) % 16u;
        var s = out.v[e];
        for (var k = 0u; k < 16u; k++) {
            let x = As[a.blk][emu_index(a.off, row, k, a.col_major, a.stride)];
            let y = Bs[b.blk][emu_index(b.off, k, col, b.col_major, b.stride)];
            s += f32(x) * f32(y);
        }
        out.v[e] = s;
    }
    return out;
}

fn emu_store_cs(blk: u32, m: EmuF, stride: u32) {
    for (var e = 0u; e < 8u; e++) {
        Cs[blk][stride * ((emu_lane * 8u + e) / 16u) + (emu_lane * 8u + e) % 16u] = m.v[e];
    }
}

fn emu_store_c(off: u32, m: EmuF, stride: u32) {
    for (var e = 0u; e < 8u; e++) {
        C[off + stride * ((emu_lane * 8u + e) / 16u) + (emu_lane * 8u + e) % 16u] = m.v[e];
    }
}

fn emu_load_c(off: u32, stride: u32) -> EmuF {
    var m: EmuF;
    for (var e = 0u; e < 8u; e++) {
        m.v[e] = C[off + stride * ((emu_lane * 8u + e) / 16u) + (emu_lane * 8u + e) % 16u];
    }
    return m;
}
