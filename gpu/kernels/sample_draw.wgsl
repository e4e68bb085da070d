// Sampled store, second pass over the vocabulary: per row and piece, each threshold t with Base[c] <= t <
// Base[c + 1] (exactly one piece holds it: the bases ascend from 0 to S > t) is located inside the piece: in the
// piece's frame t' = (t - Base[c]) / exp(m_c - m) (kept below the piece's sum), the segment w with Incl[w - 1] <=
// t' < Incl[w] walks its ids in order to the first with Incl[w - 1] + (running sum) > t' (sample_piece.wgsl: the
// same additions as the scan's). Writes the draw's id and z / tau. No atomics: each threshold has one writer.

@group(0) @binding(2) var<storage, read> Stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> Base: array<f32>;
@group(0) @binding(4) var<storage, read> Thr: array<f32>;
@group(0) @binding(5) var<storage, read> RowStat: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> Draws: array<u32>;
@group(0) @binding(7) var<storage, read_write> ZV: array<f32>;

fn row_main(row: u32, lid: u32) {
    let np = prm.n_pieces;
    let mc = Stats[row * np + prm.piece].x;
    _ = piece_load(row, lid);
    piece_scan(lid, mc);
    let b0 = Base[row * (np + 1u) + prm.piece];
    let b1 = Base[row * (np + 1u) + prm.piece + 1u];
    let scale = exp(mc - RowStat[row].x);
    let total = Incl[WG - 1u];
    let below = bitcast<f32>(bitcast<u32>(total) - 1u);  // total >= 1
    let seg = segment(lid);
    var excl = 0.0;
    if (lid > 0u) {
        excl = Incl[lid - 1u];
    }
    let incl = Incl[lid];
    let zb = row * prm.ldz + prm.z_off;
    for (var i = 0u; i < prm.n; i++) {
        let t = Thr[row * prm.n + i];
        if (t < b0 || t >= b1) {
            continue;
        }
        let tl = min((t - b0) / scale, below);
        if (tl < excl || tl >= incl) {
            continue;
        }
        var acc = 0.0;
        var v = seg.x;
        var last = seg.x;  // the last id with mass: where rounding could leave t' (never seen)
        var found = false;
        for (var j = seg.x; j < seg.y; j++) {
            acc += E[j];
            if (E[j] > 0.0) {
                last = j;
            }
            if (excl + acc > tl) {
                v = j;
                found = true;
                break;
            }
        }
        if (!found) {
            v = last;
        }
        Draws[row * prm.n + i] = prm.v0 + v;
        ZV[row * prm.n + i] = Z[zb + v] * prm.inv_tau;
    }
}
