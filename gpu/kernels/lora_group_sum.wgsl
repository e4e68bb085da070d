// Elementwise body (elementwise.wgsl): a mergeable adapter's dA projection (model/reference.py
// lora_group_project). Element i of Y [r, in] gets the sum of its group of `width` consecutive elements of X
// (the group containing i; in is a multiple of width), summed in ascending order, so every element of a group
// gets the same bits. ACC: add to Y (gradient accumulation), else overwrite it.

@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;

const ACC: bool = ${ACC};

fn op(i: u32) {
    let start = i - i % prm.width;
    var s = 0.0;
    for (var j = 0u; j < prm.width; j = j + 1u) {
        s = s + X[start + j];
    }
    if (ACC) {
        Y[i] = Y[i] + s;
    } else {
        Y[i] = s;
    }
}
