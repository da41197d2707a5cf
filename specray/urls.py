"""Credentials inside URLs: find them, refuse them, and never print them.

A URL such as ``s3://KEY:SECRET@bucket/prefix`` or ``https://user:password@minio:9000`` carries a
secret in its user information. A job file is copied into ``_job.json`` and the manifest, and
every error message quotes the field it refuses, so such a URL is refused at validation (the
message says where credentials belong) and every message that quotes a URL passes it through
:func:`redact_urls` first. Torch-free and fsspec-free: the spec (layer 1) and the storage layer
use the same functions.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "<redacted>"
CREDENTIALS_BELONG = ("credentials come from the standard AWS chain: set AWS_ACCESS_KEY_ID / "
                      "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or AWS_PROFILE in the environment, "
                      "or use an instance role")

# scheme://userinfo@ anywhere in a text; userinfo stops at the first '/', whitespace or quote.
_USERINFO_IN_TEXT = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s'\"@]*@)")
_QUERY_SECRET_WORDS = ("signature", "token", "secret", "password", "credential", "key")


def has_userinfo(url: str) -> bool:
    """Whether ``url`` (``scheme://...``) names a user or password before its host."""
    if "://" not in url:
        return False
    authority = url.split("://", 1)[1].split("/", 1)[0]
    return "@" in authority


def redact_url(url: str) -> str:
    """``url`` without its user information, and with credential-like query values hidden."""
    text = _USERINFO_IN_TEXT.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", url)
    if "?" not in text or "://" not in text:
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    query = [(k, REDACTED if any(w in k.lower() for w in _QUERY_SECRET_WORDS) else v)
             for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query, safe="<>"), parts.fragment))


def redact_urls(text: str) -> str:
    """``text`` with the user information of every URL in it replaced by ``<redacted>``."""
    return _USERINFO_IN_TEXT.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", str(text))


def safe_repr(value: object, limit: int = 80) -> str:
    """A repr for error messages: bounded, URLs redacted, and a mapping shown by its keys only (its
    values may be secrets written under the wrong key); a huge integer by its size."""
    import reprlib
    from collections.abc import Mapping

    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 96:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, Mapping):
        keys = ", ".join(safe_repr(str(k), 20) for k in list(value)[:8])
        return f"a mapping with keys [{keys}{', ...' if len(value) > 8 else ''}]"
    if isinstance(value, (list, tuple, set)) and any(isinstance(v, (Mapping, list, tuple, set)) for v in value):
        return f"a {type(value).__name__} of {len(value)} items"
    shortener = reprlib.Repr()
    shortener.maxstring, shortener.maxother, shortener.maxlevel = limit, limit, 2
    return redact_urls(shortener.repr(value))
