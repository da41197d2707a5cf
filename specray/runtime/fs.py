"""One small filesystem layer for local paths and ``s3://`` URIs.

The runtime store writes shards, manifests and reports through this module so that the same code
serves a laptop directory and an S3 bucket (or an S3-compatible store such as MinIO or moto).

Credentials are never handled here: they come from the standard AWS chain (environment,
``~/.aws/config`` / ``credentials``, instance metadata) exactly as s3fs/botocore and pyarrow resolve
them. Only the endpoint may be overridden, from ``storage_options`` or from ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``.

Visibility rule (design.md): an object becomes visible only when it is complete.
  - local: write a dot-prefixed temp file in the target directory, fsync, ``os.replace``.
  - S3: a single PUT is atomic; a multipart upload is visible only after
    ``CompleteMultipartUpload``, and on failure we abort it instead of completing it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import IO, Any
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from specray.urls import CREDENTIALS_BELONG, REDACTED, has_userinfo, redact_url, redact_urls

S3_SCHEME = "s3://"
FILE_SCHEME = "file://"
ALLOWED_URI_FORMS = "a local path, file://PATH, or s3://BUCKET/PREFIX"
ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # most specific first, as botocore does
PROBE_PREFIX = ".specray-write-probe-"

# botocore / S3 error codes that mean "the credentials were refused" (as opposed to a missing bucket).
CREDENTIAL_ERROR_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidClientTokenId",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "UnrecognizedClientException",
        "AuthFailure",
    }
)
ACCESS_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"})
MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})


class StorageError(ValueError):
    """An output location that cannot be used (bad URI, missing bucket, refused credentials, ...)."""


# ----------------------------------------------------------------------------------------- URIs


def is_s3(uri: str) -> bool:
    return str(uri).startswith(S3_SCHEME)


def _scheme_of(uri: str) -> str | None:
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    return match.group(1).lower() if match else None


def _local_path(uri: str) -> str:
    path = uri[len(FILE_SCHEME):] if uri.startswith(FILE_SCHEME) else uri
    return os.path.abspath(os.path.expanduser(path))


def _validate_uri(uri: str) -> None:
    if not isinstance(uri, (str, os.PathLike)) or not str(uri).strip():
        raise StorageError(f"storage URI must be a non-empty string ({ALLOWED_URI_FORMS}), got {uri!r}")
    scheme = _scheme_of(str(uri))
    shown = redact_url(str(uri))
    if scheme not in (None, "file", "s3"):
        raise StorageError(f"unsupported URI scheme {scheme + '://'!r} in {shown!r}; allowed: {ALLOWED_URI_FORMS}")
    if scheme is not None and has_userinfo(str(uri)):
        raise StorageError(f"{shown!r} carries credentials in the URL; {CREDENTIALS_BELONG}")
    if scheme == "s3" and not str(uri)[len(S3_SCHEME):].split("/", 1)[0]:
        raise StorageError(f"S3 URI {shown!r} has no bucket; expected s3://BUCKET/PREFIX")


def join(base: str, *parts: str) -> str:
    """Join path parts onto a local path or an s3:// URI (always '/' for S3)."""
    base = str(base)
    if is_s3(base):
        pieces = [base.rstrip("/")] + [str(p).strip("/") for p in parts if str(p).strip("/")]
        return "/".join(pieces)
    return os.path.join(base, *[str(p) for p in parts])


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len(S3_SCHEME):].partition("/")
    return bucket, key.strip("/")


# ------------------------------------------------------------------------------ filesystems


def s3_endpoint(storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The S3 endpoint override: storage_options first, then AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL."""
    options = dict(storage_options or {})
    endpoint = options.get("endpoint_url") or dict(options.get("client_kwargs") or {}).get("endpoint_url")
    if endpoint:
        return str(endpoint)
    for name in ENDPOINT_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _s3_filesystem(storage_options: Mapping[str, Any] | None, fresh: bool) -> fsspec.AbstractFileSystem:
    import s3fs

    options: dict[str, Any] = dict(storage_options or {})
    endpoint = s3_endpoint(options)
    options.pop("endpoint_url", None)
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if options.get("region_name"):  # accepted at top level for symmetry with pyarrow_filesystem
        client_kwargs.setdefault("region_name", options.pop("region_name"))
    # Other processes (Ray actors) write the objects we list; a cached listing would hide them.
    options.setdefault("use_listings_cache", False)
    if fresh:
        # A cached instance keeps the credentials it was built with; a check must see the current ones.
        options["skip_instance_cache"] = True
    return s3fs.S3FileSystem(client_kwargs=client_kwargs, **options)


def resolve(
    uri: str, storage_options: Mapping[str, Any] | None = None, *, fresh: bool = False
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path-within-it) for a local path, file:// URI or s3://bucket/prefix.

    Local paths are made absolute. For S3 the path is ``bucket/key`` (fsspec convention).
    ``fresh=True`` bypasses fsspec's instance cache (used by checks that must see current credentials).
    """
    _validate_uri(uri)
    uri = str(uri)
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        return _s3_filesystem(storage_options, fresh), f"{bucket}/{key}" if key else bucket
    return LocalFileSystem(), _local_path(uri)


def pyarrow_filesystem(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(pyarrow.fs.FileSystem, path) for readers that want pyarrow's native filesystems.

    Do not publish shards through its output streams: like fsspec's ``open``, a pyarrow S3 output
    stream closed by an exception completes the upload and leaves a partial object visible. Write
    with :func:`atomic_writer` / :func:`atomic_write_bytes` instead.
    """
    import pyarrow.fs as pafs

    _validate_uri(uri)
    uri = str(uri)
    if not is_s3(uri):
        return pafs.LocalFileSystem(), _local_path(uri)
    options = dict(storage_options or {})
    kwargs: dict[str, Any] = {}
    endpoint = s3_endpoint(options)
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme
    region = (
        options.get("region_name")
        or dict(options.get("client_kwargs") or {}).get("region_name")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    if region:
        kwargs["region"] = region
    elif endpoint:
        kwargs["region"] = "us-east-1"  # S3-compatible stores ignore it; avoids pyarrow's region probe
    # Explicit keys only when the caller passed them; otherwise pyarrow uses the AWS default chain.
    if options.get("key") and options.get("secret"):
        kwargs["access_key"] = options["key"]
        kwargs["secret_key"] = options["secret"]
        if options.get("token"):
            kwargs["session_token"] = options["token"]
    bucket, key = _split_s3(uri)
    return pafs.S3FileSystem(**kwargs), f"{bucket}/{key}" if key else bucket


def _to_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else S3_SCHEME + path


# ------------------------------------------------------------------------------- operations


def exists(uri: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    fs, path = resolve(uri, storage_options)
    return bool(fs.exists(path))


def read_bytes(uri: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    fs, path = resolve(uri, storage_options)
    return fs.cat_file(path)


def remove(uri: str, storage_options: Mapping[str, Any] | None = None, *, missing_ok: bool = True) -> None:
    fs, path = resolve(uri, storage_options)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def list_files(
    uri_prefix: str, suffix: str = "", storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Sorted URIs of all files under a prefix (recursive) whose names end with ``suffix``.

    Dot-prefixed names (in-progress temp files, write probes) are never listed. A missing prefix
    lists as empty.
    """
    fs, path = resolve(uri_prefix, storage_options)
    try:
        found = fs.find(path)
    except FileNotFoundError:
        return []
    uris = [
        _to_uri(fs, p)
        for p in found
        if p.endswith(suffix) and not p.rstrip("/").rsplit("/", 1)[-1].startswith(".")
    ]
    return sorted(uris)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform/filesystem; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(name: str, tag: str = "") -> str:
    """The dot-prefixed temp name a writer of ``name`` uses; ``tag`` (a run's identity) lets that run
    recognise its own leftovers and leave every other file alone."""
    return f".{name}.tmp-{tag + '-' if tag else ''}{uuid.uuid4().hex}"


@contextlib.contextmanager
def _local_atomic_writer(path: str, tag: str = "") -> Iterator[IO[bytes]]:
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory, temp_name(name, tag))
    try:
        with open(tmp_path, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise
    _fsync_directory(directory)


@contextlib.contextmanager
def _s3_atomic_writer(fs: fsspec.AbstractFileSystem, path: str, block_size: int | None) -> Iterator[IO[bytes]]:
    # fsspec's own ``with fs.open(...)`` calls close() on an exception, which COMPLETES the upload
    # and publishes a partial object. Here an exception aborts the multipart upload instead.
    handle = fs.open(path, "wb", block_size=block_size) if block_size else fs.open(path, "wb")
    try:
        yield handle
        handle.close()  # single PUT, or CompleteMultipartUpload: the only moment the object appears
    except BaseException:
        with contextlib.suppress(Exception):
            handle.discard()  # AbortMultipartUpload (no-op if nothing was uploaded yet)
        handle.closed = True  # never let __del__ -> close() commit what was written so far
        raise


@contextlib.contextmanager
def atomic_writer(
    uri: str, storage_options: Mapping[str, Any] | None = None, *, block_size: int | None = None,
    temp_tag: str = "",
) -> Iterator[IO[bytes]]:
    """Binary file object whose content becomes visible at ``uri`` only if the block exits normally.

    Do not call ``close()`` on the yielded object yourself. ``block_size`` is the S3 multipart part
    size (>= 5 MiB; s3fs default otherwise); it is ignored for local paths, where ``temp_tag`` goes
    into the temp file's name (see :func:`temp_name`).
    """
    fs, path = resolve(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        with _local_atomic_writer(path, temp_tag) as handle:
            yield handle
    else:
        with _s3_atomic_writer(fs, path, block_size) as handle:
            yield handle


def atomic_write_bytes(uri: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``data`` so that the object is visible only when complete (never partially)."""
    fs, path = resolve(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        with _local_atomic_writer(path) as handle:
            handle.write(data)
    else:
        # One PUT below 2 x chunksize; above, s3fs uses a multipart upload that it aborts on failure.
        fs.pipe_file(path, bytes(data))


# ------------------------------------------------------------------------ writability check


def _error_code(exc: BaseException) -> str | None:
    """The S3/botocore error code behind an exception (s3fs re-raises ClientError as OSError subclasses)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        name = type(current).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return name
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
            return "EndpointConnectionError"
        if name == "ParamValidationError":
            return name
        current = current.__cause__ or current.__context__
    return None


def _scrub(text: str, storage_options: Mapping[str, Any] | None) -> str:
    """Remove any credential value we know of from a message before it is shown."""
    secrets = [os.environ.get(n, "") for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
    secrets += [str(v) for k, v in dict(storage_options or {}).items() if _is_credential_key(k) and v]
    for secret in secrets:
        if len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    return redact_urls(text)


def _s3_reason(exc: BaseException, uri: str, endpoint: str | None) -> str:
    code = _error_code(exc)
    bucket = _split_s3(uri)[0]
    where = f" at endpoint {redact_url(endpoint)}" if endpoint else ""
    if code in MISSING_BUCKET_CODES or (code is None and isinstance(exc, FileNotFoundError)):
        return f"bucket {bucket!r} does not exist{where} (create it first)"
    if code in CREDENTIAL_ERROR_CODES:
        return (
            f"S3 credentials refused ({code}){where}; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
            "AWS_SESSION_TOKEN or AWS_PROFILE"
        )
    if code in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            f"no usable S3 credentials found ({code}); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run where an instance role is available"
        )
    if code in ACCESS_DENIED_CODES or (code is None and isinstance(exc, PermissionError)):
        return f"S3 credentials refused: access denied ({code or 'AccessDenied'}) for writes to bucket {bucket!r}{where}"
    if code == "EndpointConnectionError":
        return f"cannot connect to the S3 endpoint{where or ' (AWS default)'}; check AWS_ENDPOINT_URL / network"
    if code == "ParamValidationError":
        return f"invalid S3 bucket or key in {redact_url(uri)!r}"
    detail = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}" + (f" ({code})" if code else "") + f"{where}" + (f": {detail}" if detail else "")


def _check_s3_writable(uri: str, storage_options: Mapping[str, Any] | None) -> None:
    options = dict(storage_options or {})
    # Fail fast: a validation step should not spend minutes in retry back-off.
    config = dict(options.pop("config_kwargs", None) or {})
    config.setdefault("connect_timeout", 5)
    config.setdefault("retries", {"max_attempts": 2})
    options["config_kwargs"] = config
    fs, path = resolve(uri, options, fresh=True)
    probe = f"{path.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"specray write probe\n")
        fs.rm_file(probe)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear StorageError
        reason = _scrub(_s3_reason(exc, uri, s3_endpoint(storage_options)), storage_options)
        raise StorageError(f"output {redact_url(uri)!r} cannot be written: {reason}") from None


def _first_existing_ancestor(path: str) -> str:
    current = path
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _check_local_writable(uri: str) -> None:
    path = _local_path(uri)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StorageError(f"output {uri!r} cannot be written: {path} exists and is a file, not a directory")
    ancestor = _first_existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise StorageError(
            f"output {uri!r} cannot be written: {ancestor} is a file in the way (a directory is needed there)"
        )
    # Create the missing directories, write+delete a probe, then remove only what we created,
    # so a failed validation leaves nothing behind.
    missing: list[str] = []
    current = path
    while current != ancestor:
        missing.append(current)
        current = os.path.dirname(current)
    created: list[str] = []
    try:
        for directory in reversed(missing):
            os.mkdir(directory)
            created.append(directory)
        probe = os.path.join(path, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
        with open(probe, "wb") as handle:
            handle.write(b"specray write probe\n")
        os.remove(probe)
    except OSError as exc:
        reason = {
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
            errno.EROFS: "read-only filesystem",
            errno.ENOSPC: "no space left on device",
            errno.ENOTDIR: "a file is in the way (a directory is needed)",
        }.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        where = exc.filename or path
        raise StorageError(f"output {uri!r} cannot be written: {reason} ({where})") from None
    finally:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def check_writable(uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Raise StorageError naming ``uri`` and the reason unless a probe object can be written there.

    Meant to run before Ray starts. Writes and deletes one small dot-prefixed probe under the prefix;
    for local paths, directories it had to create are removed again. Never reveals credential values.
    """
    try:
        _validate_uri(uri)
    except StorageError as exc:
        raise StorageError(f"output {redact_url(str(uri))!r} cannot be written: {exc}") from None
    if is_s3(str(uri)):
        _check_s3_writable(str(uri), storage_options)
    else:
        _check_local_writable(str(uri))


# ------------------------------------------------------------------------------- redaction

# Matched on the words of a key (snake_case, kebab-case, camelCase), so "num_tokens" or "monkey"
# stay visible while "AWS_SESSION_TOKEN", "secretAccessKey" or s3fs's bare "key" are redacted.
_CREDENTIAL_WORDS = frozenset({"secret", "token", "password", "passwd", "pwd", "credential", "credentials", "apikey"})
_CREDENTIAL_WORD_PAIRS = frozenset({("access", "key"), ("api", "key"), ("private", "key"), ("session", "key")})
_CREDENTIAL_EXACT_KEYS = frozenset({"key"})


def _key_words(name: Any) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(name))
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def _is_credential_key(name: Any) -> bool:
    words = _key_words(name)
    if "_".join(words) in _CREDENTIAL_EXACT_KEYS:
        return True
    # "<quantity> per token" (nats_per_token, ms_per_token) is a unit, not a credential
    if any(w in _CREDENTIAL_WORDS and not (i and words[i - 1] == "per") for i, w in enumerate(words)):
        return True
    return any(pair in _CREDENTIAL_WORD_PAIRS for pair in zip(words, words[1:]))


def redact(obj: Any) -> Any:
    """A copy of ``obj`` with credential-like entries replaced by '<redacted>'.

    Dict keys with a word secret/token/password/credential(s) or access_key/api_key/private_key
    (and s3fs's bare ``key``) have their values replaced; URLs lose embedded user:password.
    Use on anything written to manifests, dataset cards or logs.
    """
    if isinstance(obj, Mapping):
        return {k: (REDACTED if _is_credential_key(k) and v not in (None, "") else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_url(obj) if "://" in obj else obj
    return obj
