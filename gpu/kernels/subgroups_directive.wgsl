// The subgroups directive where the compiler wants it (Tint: Dawn), nothing where it has none (naga: wgpu-native,
// whose subgroup builtins need no directive). First part of a kernel that uses subgroup builtins on either.
${ENABLE_SUBGROUPS}
