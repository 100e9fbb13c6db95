"""Concrete experiment code (models, datasets, tasks) that configs in conf/ point at by `_target_`."""
