"""An image's bytes from where a request points: a `data:` URI (base64) or an http(s) URL.

URLs are fetched with limits (bytes, seconds, redirects), and never from a loopback, private, link-local or
otherwise non-public address unless the host is in `allowed_domains` (--allowed-media-domains): a server must not
become a way into its own network. Every redirect's target is checked again.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import requests

from services.tokenizer.images.decode import ImageError


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0  # the whole fetch, every redirect included
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] = ()  # hosts fetched whatever their address


def load(url: str, limits: FetchLimits) -> bytes:
    """The bytes `url` names (ImageError with the reason when it cannot be had within the limits)."""
    if url.startswith("data:"):
        return _data_uri(url, limits.max_bytes)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageError(f"image URL must be a data: URI or an http(s) URL, got scheme {scheme!r}")
    return _fetch(url, limits)


def _data_uri(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("malformed data: URI (no comma)")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"image is over the limit of {max_bytes} bytes")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("malformed data: URI (bad base64)") from None
    return unquote_to_bytes(payload)


def check_host(host: str, allowed: tuple[str, ...]) -> None:
    """Refuse a host that resolves to a non-public address, unless it is allowed by name."""
    if host.lower().rstrip(".") in {d.lower().rstrip(".") for d in allowed}:
        return
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        raise ImageError(f"image URL host {host!r} does not resolve") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global or address.is_multicast:
            raise ImageError(
                f"image URL host {host!r} is a non-public address ({address}); list it in --allowed-media-domains"
            )


def _fetch(url: str, limits: FetchLimits) -> bytes:
    deadline = time.monotonic() + limits.timeout_s
    for _ in range(limits.max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ImageError(f"image URL {url!r} is not an http(s) URL")
        check_host(parts.hostname, limits.allowed_domains)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ImageError(f"fetching the image took longer than {limits.timeout_s:g} s")
        try:
            with requests.get(url, stream=True, timeout=left, allow_redirects=False) as r:
                if r.is_redirect:
                    url = urljoin(url, r.headers.get("location", ""))
                    continue
                if r.status_code != 200:
                    raise ImageError(f"fetching the image failed: HTTP {r.status_code}")
                return _read(r, limits.max_bytes, deadline, limits.timeout_s)
        except requests.Timeout:
            raise ImageError(f"fetching the image took longer than {limits.timeout_s:g} s") from None
        except requests.RequestException as e:
            raise ImageError(f"fetching the image failed: {type(e).__name__}") from None
    raise ImageError(f"fetching the image was redirected more than {limits.max_redirects} times")


def _read(r: requests.Response, max_bytes: int, deadline: float, timeout_s: float) -> bytes:
    length = r.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ImageError(f"image is over the limit of {max_bytes} bytes")
    body = bytearray()
    for chunk in r.iter_content(64 * 1024):
        body += chunk
        if len(body) > max_bytes:
            raise ImageError(f"image is over the limit of {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise ImageError(f"fetching the image took longer than {timeout_s:g} s")
    return bytes(body)
