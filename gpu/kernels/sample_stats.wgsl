// Sampled store, first pass over the vocabulary: per row and piece (m_c, s_c) = (max z / tau, sum exp(z / tau -
// m_c)) summed as sample_piece.wgsl does, into Stats[row, piece]. sample_thresholds.wgsl turns them into the CDF's
// piece bases and the thresholds.

struct Params {
    T: u32,
    nv: u32,        // piece columns (<= PIECE)
    ldz: u32,       // row stride of Z
    z_off: u32,     // column of the piece's first logit inside a row of Z
    v0: u32,        // vocab id of that column
    piece: u32,     // index of the piece in the row
    n_pieces: u32,
    n: u32,         // draws per position
    inv_tau: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Z: array<f32>;
@group(0) @binding(2) var<storage, read_write> Stats: array<vec2<f32>>;

fn row_main(row: u32, lid: u32) {
    let mc = workgroup_reduce(lid, piece_load(row, lid));
    piece_scan(lid, mc);
    if (lid == 0u) {
        Stats[row * prm.n_pieces + prm.piece] = vec2<f32>(mc, Incl[WG - 1u]);
    }
}
