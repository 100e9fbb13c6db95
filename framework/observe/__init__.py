"""What a run reports: every number through the metric logger (`metric_logger`) to TensorBoard (`tensorboard`) and
the trackers (`trackers`: CSV, MLflow, W&B), the progress bar (`progress`), provenance, the profiler, the setup
report and model summary, and the closing summary."""
