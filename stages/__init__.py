"""The pipeline's stages as plain library functions: run(cfg, *upstream) -> Manifest; no Prefect, no MLflow."""
