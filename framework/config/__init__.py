"""The config: the typed schema conf/ is composed against and its checks at the edge (`schema`), building objects by
`_target_` (`instantiate`). Public: `register()` (the schemas, before Hydra composes) and `validate(cfg)`."""

from framework.config.schema import register, validate

__all__ = ["register", "validate"]
