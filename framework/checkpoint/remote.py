"""A remote store of checkpoints (`checkpoint.remote=URL`): a probe write that tells, before a run starts, whether it
can be written at all. The URL's checks, its file system and the causes of a failure: framework/core/stores.py.

The layout of a remote and how a checkpoint is published there: framework/checkpoint/upload.py.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping, Optional

from framework.core.errors import ConfigError
from framework.core.stores import Store, cause, is_store_error, open_store

log = logging.getLogger(__name__)

EXPECTED_STORE = (
    "expected a bucket that exists and credentials that may write to it, from the environment "
    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; the endpoint from AWS_ENDPOINT_URL or "
    "checkpoint.remote_options.endpoint_url)"
)


def probe(key: str, store: Store) -> None:
    """Write a small object under the store's root and delete it; ConfigError naming `key` and the cause where
    that fails (no credentials, an endpoint that cannot be reached, no such bucket, access denied)."""
    name = store.path(f".htf-probe-{uuid.uuid4().hex}")
    try:
        store.fs.pipe_file(name, b"probe")
        store.fs.rm_file(name)
    except Exception as err:
        if not is_store_error(err):
            raise
        log.debug("probe of %s failed", store.url, exc_info=True)
        raise ConfigError(f"{key}={store.url!r}: cannot write there: {cause(err)}; {EXPECTED_STORE}") from None


def checked_store(key: str, url: str, options: Optional[Mapping[str, Any]] = None) -> Store:
    """The store at `url`, checked and probed (see open_store, probe): what a run that writes there starts with."""
    store = open_store(key, url, options)  # (a URL fsspec knows, not yet contacted)
    check_writable_url(key, url)
    probe(key, store)
    return store


def refuse_another_run(key: str, store: Store) -> None:
    """A new run's remote must hold no run's checkpoints: the new run's would be published over them, and the keep
    policies would withdraw the rest (`resume=URL` continues the run that is there)."""
    from framework.checkpoint.upload import manifests

    published = manifests(store)
    if published:
        newest = max(int(m.get("step", -1)) for m in published.values())
        raise ConfigError(
            f"{key}={store.url!r}: holds another run's checkpoints ({', '.join(sorted(published))}; the newest at "
            f"step {newest}), which this new run's would replace; expected a prefix of its own, or "
            f"resume={store.url} to continue that run"
        )


def check_writable_url(key: str, url: str) -> None:
    """A URL a run may keep its copy at: a store that outlives the process (not memory://), a prefix of its own
    under a bucket (not the bucket's root, where withdrawing its checkpoints would list everything), no `..`
    (object stores keep it as a literal name)."""
    scheme, _, rest = url.partition("://")
    parts = [p for p in rest.split("/") if p]
    if scheme == "memory":
        raise ConfigError(f"{key}={url!r}: memory:// is gone when the process ends; expected a store that outlives it")
    if ".." in parts or "." in parts:
        raise ConfigError(f"{key}={url!r}: a path with . or ..; expected SCHEME://BUCKET/PREFIX without them")
    if scheme not in ("file", "local") and len(parts) < 2:
        raise ConfigError(
            f"{key}={url!r}: a bucket's root; expected a prefix of the run's own under it, e.g. {url.rstrip('/')}/exp1"
        )
