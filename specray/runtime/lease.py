"""One writer per output: a lease that a second run of the same output sees and refuses.

The driver of a run takes the lease ``<output>/_lease.json`` before it reads or writes anything
else there, and gives it back when the run ends (the file is removed). A second run into the same
output finds it held and is refused with a message naming the holder (host, pid, job, since when).

- **Local paths**: an exclusive ``flock`` on the lease file. The kernel releases it when the
  holder's process dies, however it dies, so a rerun after a crash takes it over at once; the
  file's content only describes the holder for the refusal message.
- **S3**: a conditional PUT. ``If-None-Match: *`` creates the lease only if no lease object
  exists; the holder renews it every ``ttl_s / 4`` seconds with ``If-Match: <its ETag>``. A lease
  not renewed for ``ttl_s`` (by the store's clock: Last-Modified against the response's Date) is
  taken over with ``If-Match`` on the stale ETag, so of two runs taking over at once exactly one
  wins. A holder whose renewal is refused has lost the lease: :attr:`OutputLease.lost` is set and
  the coordinator stops before writing the manifest.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from specray.runtime import fs as storage
from specray.runtime.store import LEASE_NAME, RunStore
from specray.spec import SpecError
from specray.urls import redact_url

log = logging.getLogger("specray.lease")

LEASE_TTL_S = 60.0  # S3: a lease not renewed for this long belongs to a dead run


class OutputBusyError(SpecError):
    """Another run holds the output's lease (field ``output``; the CLI exits 2 as for any bad input)."""


class LeaseLostError(RuntimeError):
    """This run's lease was taken over (it was presumed dead); it must stop writing."""


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _holder_text(record: dict[str, Any] | None) -> str:
    if not record:
        return "a run that has not described itself yet"
    return (f"job {record.get('job_id')!r} (pid {record.get('pid')} on {record.get('host')}, "
            f"started {record.get('started_at')}, run {str(record.get('run_id'))[:8]})")


class OutputLease:
    """The single-writer lease of one output. Use as a context manager around a run."""

    def __init__(self, store: RunStore, *, job_id: str, fingerprint: str, ttl_s: float = LEASE_TTL_S):
        self.store = store
        self.ttl_s = float(ttl_s)
        self.record = {"run_id": uuid.uuid4().hex, "job_id": job_id, "fingerprint": fingerprint,
                       "host": socket.gethostname(), "pid": os.getpid(), "started_at": _now_iso()}
        self.lost = threading.Event()
        self.held = False
        self._fd: int | None = None
        self._created_dirs: list[str] = []
        self._etag: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- the two backends ------------------------------------------------------------------

    def acquire(self) -> "OutputLease":
        """Take the lease or raise :class:`OutputBusyError` naming the holder (nothing else is touched)."""
        if self.store.is_local:
            self._acquire_local()
        else:
            self._acquire_s3()
        self.held = True
        return self

    def release(self) -> None:
        """Give the lease back (remove the lease file); a lost lease is left to its new holder."""
        if not self.held:
            return
        self.held = False
        if self.store.is_local:
            self._release_local()
        else:
            self._release_s3()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` when another run took the lease over."""
        if self.lost.is_set():
            raise LeaseLostError(f"output {redact_url(self.store.output)!r} was taken over by another run "
                                 "(this run had not renewed its lease in time); stopping without a manifest")

    def __enter__(self) -> "OutputLease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- local: flock ------------------------------------------------------------------------

    @property
    def _local_path(self) -> str:
        return os.path.join(self.store.root, LEASE_NAME)

    def _make_root(self) -> None:
        missing, current = [], self.store.root
        while not os.path.isdir(current):
            missing.append(current)
            current = os.path.dirname(current)
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory)
                self._created_dirs.append(directory)

    def _acquire_local(self) -> None:
        import fcntl

        self._make_root()
        path = self._local_path
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                self._remove_created_dirs()
                raise OutputBusyError("output", self._busy_message(self._read_local())) from None
            try:  # the holder may have removed the file between our open and our lock: lock the current one
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(self.record, sort_keys=True) + "\n").encode())
        os.fsync(fd)
        self._fd = fd

    def _read_local(self) -> dict[str, Any] | None:
        try:
            with open(self._local_path, "rb") as handle:
                return json.loads(handle.read(64 * 1024) or b"null")
        except (OSError, ValueError):
            return None

    def _release_local(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._local_path)  # while still locked: a waiting run then locks a new file
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._remove_created_dirs()

    def _remove_created_dirs(self) -> None:
        for directory in reversed(self._created_dirs):  # only when empty: a refused run leaves nothing
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        self._created_dirs = []

    def _busy_message(self, holder: dict[str, Any] | None, extra: str = "") -> str:
        return (f"{redact_url(self.store.output)!r} is being written by another run: "
                f"{_holder_text(holder)}. Two runs must not write one output; wait for that run to finish"
                f"{extra}, or choose another output")

    # -- S3: conditional puts -------------------------------------------------------------------

    @property
    def _bucket_key(self) -> tuple[str, str]:
        bucket, _, prefix = self.store.root.partition("/")
        return bucket, f"{prefix.rstrip('/')}/{LEASE_NAME}" if prefix else LEASE_NAME

    def _put(self, **condition: str) -> str:
        bucket, key = self._bucket_key
        body = json.dumps({**self.record, "renewed_at": _now_iso()}, sort_keys=True).encode()
        response = self.store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **condition)
        return str(response.get("ETag", ""))

    def _acquire_s3(self) -> None:
        try:
            self._etag = self._put(IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001 - only a failed precondition means "held"
            if storage._error_code(exc) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
            self._take_over_if_stale()
        self._renewer = threading.Thread(target=self._renew_loop, name="specray-lease", daemon=True)
        self._renewer.start()

    def _take_over_if_stale(self) -> None:
        bucket, key = self._bucket_key
        try:
            head = self.store.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:  # released between our put and our look: try once more
            self._etag = self._put(IfNoneMatch="*")
            return
        try:
            holder = json.loads(self.store.fs.cat_file(f"{bucket}/{key}"))
        except Exception:  # noqa: BLE001 - the description is only for the message
            holder = None
        age = _server_age_s(head)
        if age < self.ttl_s:
            raise OutputBusyError("output", self._busy_message(
                holder, f" (its lease was renewed {age:.0f} s ago; if that run died, the lease expires "
                        f"{self.ttl_s - age:.0f} s from now and a rerun then takes it over)"))
        try:
            self._etag = self._put(IfMatch=str(head["ETag"]))
        except Exception as exc:  # noqa: BLE001
            if storage._error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "NoSuchKey"):
                raise OutputBusyError("output", self._busy_message(None, " (another run took the expired "
                                                                        "lease over just now)")) from None
            raise
        log.warning("took over the lease of %s from %s, which had not renewed it for %.0f s",
                    redact_url(self.store.output), _holder_text(holder), age)

    def _renew_loop(self) -> None:
        period = self.ttl_s / 4
        last_ok = time.monotonic()
        while not self._stop.wait(period):
            try:
                self._etag = self._put(IfMatch=str(self._etag))
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001
                code = storage._error_code(exc)
                if code in ("PreconditionFailed", "412", "NoSuchKey") or isinstance(exc, FileNotFoundError) \
                        or time.monotonic() - last_ok > self.ttl_s:
                    log.error("lost the lease of %s (%s); this run stops", redact_url(self.store.output),
                              code or type(exc).__name__)
                    self.lost.set()
                    return
                log.warning("could not renew the lease of %s (%s); retrying",
                            redact_url(self.store.output), code or type(exc).__name__)

    def _release_s3(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
        if self.lost.is_set():
            return
        bucket, key = self._bucket_key
        with contextlib.suppress(Exception):
            head = self.store.fs.call_s3("head_object", Bucket=bucket, Key=key)
            if str(head.get("ETag")) == str(self._etag):  # never remove a lease someone else holds now
                self.store.fs.call_s3("delete_object", Bucket=bucket, Key=key)


def _server_age_s(head: dict[str, Any]) -> float:
    """Seconds since the object was last written, by the store's own clock (no clock skew)."""
    modified = head.get("LastModified")
    date = ((head.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
    now = email.utils.parsedate_to_datetime(date) if date else datetime.now(timezone.utc)
    if modified is None:
        return 0.0
    if modified.tzinfo is None:
        modified = modified.replace(tzinfo=timezone.utc)
    return max(0.0, (now - modified).total_seconds())
