"""The config: the typed schema conf/ is composed against (`schema`), the checks at the edge (`validate`, with
Lightning's names and typos answered by `hints`), `${...}` as data (`interpolation`) and building objects by
`_target_` (`instantiate`). Public: `register()` (the schemas, before Hydra composes) and `validate(cfg)`."""

from framework.config.schema import register
from framework.config.validate import validate

__all__ = ["register", "validate"]
