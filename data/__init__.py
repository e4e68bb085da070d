"""The data distillery reads and writes: user datasets (records), token shards, teacher top-k shards,
training checkpoints, and exported adapters. Formats only: the model itself lives in model/."""
