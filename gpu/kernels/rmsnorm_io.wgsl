// RMSNorm's params, input, weight and output (rmsnorm_forward.wgsl, rmsnorm_i8.wgsl; weight and output as vec4s:
// rmsnorm_i8_units.wgsl).

struct Params {
    T: u32,
    H: u32,
    eps: f32,
    skip_y: u32,  // rmsnorm_i8_units: 1 leaves Y unwritten (the caller needs the codes alone)
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> Wn: array<${IO_ELEM}>;
@group(0) @binding(3) var<storage, read_write> Y: array<${IO_ELEM}>;
