"""A Hydra-driven, Lightning-style experiment framework for PyTorch."""
