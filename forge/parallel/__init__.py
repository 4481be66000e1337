"""Device mesh, FSDP2, tensor and pipeline parallelism, applied in one fixed order."""
