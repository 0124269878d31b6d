"""The ComfyUI side of loaders/: the patcher whose blocks stream, run plans, version probes,
the live feed and the plan route's file plans (it imports model_file, lora and swap)."""
