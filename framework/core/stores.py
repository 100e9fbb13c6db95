"""Stores named by URL, read and written through fsspec: `checkpoint.remote` and `resume=`/`ckpt=`/`init_from=`
URLs (framework/checkpoint/remote.py), and WebDataset shards at a URL (`data.train_shards='s3://...'`,
framework/data/shard_files.py). Here: the URL checked, the file system fsspec opens for it, and a failure of the
store described in a few words.

Credentials never come from the config: a URL holding them, or a storage option named like a secret, is refused
(the config is saved with the run). s3fs reads them from the environment as botocore does (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE), and the endpoint from AWS_ENDPOINT_URL or the key's storage
options (`checkpoint.remote_options.endpoint_url`). Every call is bounded: botocore connects within CONNECT_TIMEOUT_S
and tries each request at most twice, so an unreachable store is an error within seconds, never a hang.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from framework.core.errors import ConfigError

log = logging.getLogger(__name__)

S3_EXTRA = "pip install 'hydra-torch-framework[s3]'"
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
# botocore's retries of one request; s3fs adds its own few, with a short backoff, for connection errors.
S3_CONFIG = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "read_timeout": READ_TIMEOUT_S,
    "retries": {"max_attempts": 2, "mode": "standard"},
}
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
_SECRET = re.compile(r"key|secret|token|password|passwd|credential|session", re.IGNORECASE)
_EXPECTED_URL = "expected SCHEME://BUCKET/PREFIX, such as s3://my-bucket/runs/exp1"


def is_url(value: Any) -> bool:
    """Is `value` a URL (`scheme://...`) rather than a local path?"""
    return isinstance(value, str) and "://" in value


def redacted(url: str) -> str:
    """`url` with whatever stands before `@` in its host part (user and password) as `***`."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://***@{host.rpartition('@')[2]}{slash}{path}" if "@" in host else url


def check_url(key: str, url: str) -> str:
    """The scheme of `url`, which fsspec can open; else ConfigError naming `key`: not a URL, credentials in it, a
    scheme fsspec does not know, or one whose library is not installed (s3fs: the `s3` extra)."""
    import fsspec

    match = _SCHEME.match(url)
    if match is None or not match.group(2).strip("/"):
        raise ConfigError(f"{key}={url!r}: not a URL; {_EXPECTED_URL}")
    scheme, rest = match.groups()
    if "@" in rest.partition("/")[0]:
        plain = f"{scheme}://{rest.partition('/')[0].rpartition('@')[2]}/{rest.partition('/')[2]}"
        raise ConfigError(
            f"{key}={redacted(url)!r}: the URL holds credentials, and the run's config is saved with it; expected "
            f"{plain.rstrip('/')} with the credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
        )
    if urlsplit(url).query:
        raise ConfigError(f"{key}={url!r}: a URL with a query (?...); {_EXPECTED_URL}")
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        known = ", ".join(f"{p}://" for p in ("s3", "gs", "az", "hf", "file", "memory"))
        raise ConfigError(
            f"{key}={url!r}: unknown scheme {scheme}:// (fsspec has no file system for it); "
            f"expected one fsspec knows, such as {known}"
        ) from None
    except ImportError as err:
        hint = S3_EXTRA if scheme in ("s3", "s3a") else str(err).splitlines()[0]
        raise ConfigError(f"{key}={url!r}: {scheme}:// needs a library that is not installed: {hint}") from None
    return scheme


def check_options(prefix: str, options: Optional[Mapping[str, Any]]) -> None:
    """Refuse a storage option that holds a secret (`key`, `secret`, `token`, `password`, ...), at any depth: the
    config is saved with the run. ConfigError naming the option (under `prefix`), never its value."""
    for name, value in (options or {}).items():
        if _SECRET.search(str(name)):
            raise ConfigError(
                f"{prefix}.{name}: a secret in the config would be saved with the run (.hydra/, every "
                "checkpoint's meta.json); expected it in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_SESSION_TOKEN or AWS_PROFILE)"
            )
        if isinstance(value, Mapping):
            check_options(f"{prefix}.{name}", value)


def storage_options(scheme: str, options: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """fsspec's keyword arguments for `scheme`: the user's `options` over the framework's bounded timeouts (s3)."""
    given = {name: value for name, value in (options or {}).items() if value is not None}
    if scheme in ("file", "local"):  # object stores have no folders to make; a local file system must make them
        return {"auto_mkdir": True, **given}
    if scheme not in ("s3", "s3a"):
        return given
    config = {**S3_CONFIG, **dict(given.pop("config_kwargs", None) or {})}
    return {"skip_instance_cache": True, "use_listings_cache": False, **given, "config_kwargs": config}


def cause(err: BaseException) -> str:
    """What went wrong with a store, in a few words and the library's first line."""
    name, text = type(err).__name__, (str(err).splitlines() or [""])[0][:200]
    if name == "NoCredentialsError":
        return "no credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set, nor a profile)"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
        return f"the endpoint cannot be reached ({text})"
    if isinstance(err, PermissionError):
        return f"access denied ({text})"
    if isinstance(err, FileNotFoundError):
        return f"not found ({text})"
    return f"{name}: {text}" if text else name


def is_store_error(err: BaseException) -> bool:
    """Is `err` a failure of the store (an OSError, or botocore's and aiohttp's own, which are not OSErrors)?"""
    return isinstance(err, OSError) or type(err).__module__.startswith(("botocore", "aiobotocore", "s3fs", "aiohttp"))


@dataclass
class Store:
    """A remote opened through fsspec: `fs`, and `root`, the URL's path in it (no trailing slash)."""

    url: str
    fs: Any
    root: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])


def open_store(key: str, url: str, options: Optional[Mapping[str, Any]] = None) -> Store:
    """The store at `url` (checked: see check_url, check_options), not yet contacted."""
    import fsspec

    scheme = check_url(key, url)
    check_options(f"{key}_options", options)
    fs, root = fsspec.core.url_to_fs(url, **storage_options(scheme, options))
    if getattr(fs, "async_impl", False):
        _quiet_event_loop()
    return Store(url.rstrip("/"), fs, str(root).rstrip("/"))


def _quiet_event_loop() -> None:
    """What fsspec's event loop (an async store's: s3fs's aiohttp) reports of a connection a failing store closed
    goes to run.log, not the console: its failure is already one warning (asyncio's default handler prints a
    traceback through the `asyncio` logger, which other code's messages share)."""
    from fsspec.asyn import get_loop

    def handler(loop: Any, context: dict[str, Any]) -> None:
        log.debug("the store's event loop: %s", context.get("message"), exc_info=context.get("exception"))

    get_loop().set_exception_handler(handler)
