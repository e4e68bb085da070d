// Sampled store, first pass over the vocabulary: per row and piece (m_c, s_c) = (max z / tau, sum exp(z / tau -
// m_c)) summed as sample_piece.wgsl does, into Stats[row, piece]. sample_thresholds.wgsl turns them into the CDF's
// piece bases and the thresholds.

@group(0) @binding(2) var<storage, read_write> Stats: array<vec2<f32>>;

fn row_main(row: u32, lid: u32) {
    let mc = workgroup_reduce(lid, piece_load(row, lid));
    piece_scan(lid, mc);
    if (lid == 0u) {
        Stats[row * prm.n_pieces + prm.piece] = vec2<f32>(mc, Incl[WG - 1u]);
    }
}
