"""Reading a job's payload: inline bytes or text, or a URI to a file under an allowed root.

Rules (each refusal is an InputError, a Refused, with a reason the dead-letter record carries):
* inline payloads and files larger than max_payload_bytes are refused before being read whole;
* a URI may only name a regular file under one of the configured input roots, after resolving
  `..` and symlinks (no traversal, no symlink escape);
* remote URLs (http, https, s3, ...) are refused unless allow_remote_uris is set.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import unquote, urlparse

from mmpipe.schemas import Payload, Refused
from mmpipe.schemas.settings import Settings


class InputError(Refused):
    """A payload refused by the input rules (size, roots, URI schemes)."""


def check_size(size: int, settings: Settings, what: str) -> None:
    if size > settings.max_payload_bytes:
        raise InputError(
            "payload_too_large", f"{what} is {size} bytes; the limit is {settings.max_payload_bytes}"
        )


def resolve_local_uri(uri: str, settings: Settings) -> Path:
    """The real path of a local URI, if it lies under an allowed input root."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        if not settings.allow_remote_uris:
            raise InputError("remote_uri_refused", f"remote URIs ({parsed.scheme}://) are not allowed here")
        raise InputError("remote_uri_unsupported", f"no fetcher for {parsed.scheme}:// URIs")
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise InputError("remote_uri_refused", f"file URI names host {parsed.netloc!r}")
    raw_path = unquote(parsed.path) if parsed.scheme == "file" else uri
    if "\x00" in raw_path:
        raise InputError("bad_uri", "path contains a NUL byte")
    try:
        # Not strict: the root check comes before any existence check, so a path outside the
        # roots gets the same answer whether or not it exists (no probing of the host's files).
        real = Path(raw_path).resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops, permissions
        raise InputError("bad_uri", f"cannot resolve {raw_path}: {exc}") from None
    roots = [root.resolve() for root in settings.input_roots]
    if not any(real.is_relative_to(root) for root in roots):
        raise InputError(
            "uri_outside_input_roots",
            f"{raw_path} resolves outside the allowed input roots ({', '.join(map(str, roots))})",
        )
    if not real.exists():
        raise InputError("file_not_found", f"no such file: {raw_path}")
    if not real.is_file():
        raise InputError("bad_uri", f"{raw_path} is not a regular file")
    check_size(real.stat().st_size, settings, f"file {raw_path}")
    return real


async def read_payload(payload: Payload, settings: Settings) -> bytes | str | Path:
    """Inline bytes, inline text, or a checked Path (decoders read files themselves)."""
    if payload.text is not None:
        check_size(len(payload.text.encode("utf-8")), settings, "inline text")
        return payload.text
    if payload.data is not None:
        check_size(len(payload.data), settings, "inline payload")
        return payload.data
    assert payload.uri is not None
    return await asyncio.to_thread(resolve_local_uri, payload.uri, settings)
