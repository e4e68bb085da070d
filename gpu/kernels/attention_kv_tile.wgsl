// Key/value tile staging shared by attention_forward and attention_backward_dq: keys j0 .. j0+BK-1 of kv head
// g into the workgroup arrays Ks, Vs (zero past T). Each kernel declares K, V, Ks, Vs.
fn stage_kv_tile(j0: u32, g: u32, lid: u32) {
    for (var u = lid; u < BK * DV; u += BQ) {
        let j = j0 + u / DV;
        var kv = vec4<f32>(0.0);
        var vv = vec4<f32>(0.0);
        if (j < prm.T) {
            let src = (j * prm.HKV + g) * DV + u % DV;
            kv = K[src];
            vv = V[src];
        }
        Ks[u] = kv;
        Vs[u] = vv;
    }
}
