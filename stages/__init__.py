"""The pipeline's stages as plain library functions, each `run(cfg, *upstream) -> manifest`; no Prefect, no MLflow.

    tokenize.run(cfg)                                         -> TokenizeManifest
    student.run(cfg)                                          -> StudentManifest (requantized, uploaded)
    teacher.run(cfg, tokens)                                  -> TeacherManifest (plan + shard + finish)
    prefix.run(cfg, student, tokens)                          -> PrefixManifest | None (frozen-prefix cache)
    train.run(cfg, student, tokens, teacher)                  -> [CheckpointManifest] (run_epoch per epoch)
    evaluate.run(cfg, student, tokens, teacher, checkpoint)   -> EvalManifest; evaluate.select_best
    export.run(cfg, student, checkpoint)                      -> ExportManifest

A stage writes into <workdir>/<folder>/<content key> (layout.py, keys.py) and returns a manifest whose paths
are relative to the workdir (`manifest.path_in(workdir)`). inputs.check_inputs refuses unusable inputs before
any stage. Progress goes through a bar factory (progress.py), messages through `logging`; tasks/ wraps each
stage in a cached Prefect task. graph.py declares the order once: each stage's node, the two pipelines.
"""
