"""fetch_document: fetch one URL and return its normalized text.

The model chooses the URL, so every hop is checked before it is fetched:
the host must be on the operator's allow-list, and every address it resolves
to must be public (unless the operator allows private ones). Redirects are
followed by hand, at most MAX_REDIRECTS, each hop checked again: a redirect
must not be a way around the allow-list.

The connection goes to the address that was checked, not to whatever a
second DNS lookup returns (DNS rebinding): the URL's host is replaced by the
checked IP, and the real name is sent as the Host header and as the TLS
server name, so the certificate is still verified against the real name.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any

import httpx

from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

MAX_REDIRECTS = 3
MAX_TIMEOUT_S = 8.0
DEFAULT_MAX_CHARS = 20_000
DEFAULT_MAX_BYTES = 2_000_000
REDIRECT_STATUSES = {301, 302, 303, 307, 308}

HTML_TYPES = {"text/html", "application/xhtml+xml"}
TEXT_TYPES = {"text/plain", "application/json"}


def fetch_document(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    settings = ctx.settings
    allowed_hosts = [str(h).lower().rstrip(".") for h in settings.get("allowed_hosts", [])]
    allow_private = bool(settings.get("allow_private_addresses", False))
    max_bytes = int(settings.get("max_bytes", DEFAULT_MAX_BYTES))
    timeout_s = min(float(settings.get("timeout_s", MAX_TIMEOUT_S)), MAX_TIMEOUT_S)
    max_chars = int(arguments.get("max_chars", DEFAULT_MAX_CHARS))

    try:
        url = httpx.URL(arguments["url"])
    except (httpx.InvalidURL, TypeError) as exc:
        raise ToolRefused(f"invalid URL: {exc}") from exc

    # trust_env=False: no proxy from the environment; the checks below are
    # only meaningful if the connection goes where they say it goes.
    with httpx.Client(
        follow_redirects=False, timeout=httpx.Timeout(timeout_s), trust_env=False
    ) as client:
        # The first request plus at most MAX_REDIRECTS redirects, each checked.
        for _hop in range(MAX_REDIRECTS + 1):
            addresses = _check_url(url, allowed_hosts, allow_private)
            outcome = _get_from_first_reachable(client, url, addresses, max_bytes)
            if isinstance(outcome, _Fetched):
                break
            url = outcome
        else:
            raise ToolRefused(f"more than {MAX_REDIRECTS} redirects")

    fetched = outcome
    content_type, truncated = fetched.content_type, fetched.truncated
    try:
        decoded = fetched.body.decode(fetched.encoding, errors="replace")
    except LookupError:  # a charset Python does not know
        decoded = fetched.body.decode("utf-8", errors="replace")

    if content_type in HTML_TYPES:
        title, text = html_to_text(decoded)
    else:
        title, text = "", decoded.replace("\r\n", "\n")

    if len(text) > max_chars:
        text, truncated = text[:max_chars], True

    return {
        "url": str(url),
        "status_code": fetched.status_code,
        "content_type": content_type,
        "title": title,
        "text": text,
        "truncated": truncated,
    }


# --- the checks -------------------------------------------------------------


def host_allowed(host: str, allowed_hosts: list[str]) -> bool:
    """An entry allows itself and its subdomains; "*" allows any host."""
    host = host.lower().rstrip(".")
    return any(
        entry == "*" or host == entry or host.endswith("." + entry) for entry in allowed_hosts
    )


def address_is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # ::ffff:127.0.0.1 is 127.0.0.1: Python 3.11's properties do not see through it.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_multicast
        or ip.is_unspecified
    )


def _check_url(url: httpx.URL, allowed_hosts: list[str], allow_private: bool) -> list[str]:
    """Refuse a URL the rules forbid; return the checked addresses to connect to."""
    if url.scheme not in ("http", "https"):
        raise ToolRefused(f"scheme {url.scheme!r} is not allowed (http or https only)")
    host = url.host
    if not host:
        raise ToolRefused("URL has no host")
    if not host_allowed(host, allowed_hosts):
        raise ToolRefused(f"host {host!r} is not in the allowed hosts")

    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        # Usually a transient resolver problem; a name that does not exist
        # fails again on retry, which is harmless.
        raise ToolUnavailable(f"cannot resolve host {host!r}: {exc}") from exc

    addresses = []
    for _family, _type, _proto, _name, sockaddr in infos:
        # Drop an IPv6 zone id ("fe80::1%eth0") before parsing.
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        # Every address must pass, not just the first: the client could use any.
        if not allow_private and not address_is_public(ip):
            raise ToolRefused(f"host {host!r} resolves to a non-public address ({ip})")
        if str(ip) not in addresses:
            addresses.append(str(ip))
    if not addresses:
        raise ToolUnavailable(f"host {host!r} has no address")
    return addresses


@dataclass
class _Fetched:
    status_code: int
    content_type: str
    body: bytes
    truncated: bool
    encoding: str


def _get_from_first_reachable(
    client: httpx.Client, url: httpx.URL, addresses: list[str], max_bytes: int
) -> _Fetched | httpx.URL:
    """Try the checked addresses in resolver order, as a normal client would.

    Only a failure to connect moves on to the next address (an IPv6 address
    on a host without IPv6, say); any other outcome is the answer.
    """
    error: httpx.ConnectError | None = None
    for address in addresses:
        try:
            return _get(client, url, address, max_bytes)
        except httpx.ConnectError as exc:
            error = exc
    raise ToolUnavailable(f"could not connect to {url.host}: {error!r}") from error


def _get(
    client: httpx.Client, url: httpx.URL, address: str, max_bytes: int
) -> _Fetched | httpx.URL:
    """GET `url` from the checked `address`: the document, or the URL a redirect points to.

    Raises httpx.ConnectError as is, so the caller can try another address.
    """
    # See the module docstring: connect to the checked IP, name the real host.
    request = client.build_request(
        "GET",
        url.copy_with(host=address),
        headers={"Host": url.netloc.decode("ascii"), "Accept": "text/html, text/plain, */*"},
        extensions={"sni_hostname": url.host},
    )
    try:
        response = client.send(request, stream=True)
        try:
            location = response.headers.get("location")
            if response.status_code in REDIRECT_STATUSES and location:
                try:
                    return url.join(location)
                except httpx.InvalidURL as exc:
                    raise ToolRefused(f"invalid redirect location: {exc}") from exc
            _check_status(response.status_code)
            content_type = _mime_type(response.headers.get("content-type", ""))
            if content_type not in HTML_TYPES | TEXT_TYPES:
                # Checked before the body is read: no point downloading it.
                raise ToolRefused(f"unsupported content type {content_type or '(none)'}")
            body, truncated = _read_capped(response, max_bytes)
            return _Fetched(
                status_code=response.status_code,
                content_type=content_type,
                body=body,
                truncated=truncated,
                encoding=response.charset_encoding or "utf-8",
            )
        finally:
            response.close()
    except httpx.ConnectError:
        raise
    except httpx.DecodingError as exc:
        raise ToolRefused(f"could not decode the body of {url}: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise ToolUnavailable(f"timed out fetching {url}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise ToolUnavailable(f"could not fetch {url}: {exc!r}") from exc


def _check_status(status_code: int) -> None:
    if 400 <= status_code < 500:
        raise ToolRefused(f"HTTP {status_code} from server")
    if status_code >= 500:
        raise ToolUnavailable(f"HTTP {status_code} from server")
    if not 200 <= status_code < 300:
        raise ToolRefused(f"unexpected HTTP status {status_code}")


def _mime_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


def _read_capped(response: httpx.Response, max_bytes: int) -> tuple[bytes, bool]:
    """Read at most max_bytes of the (decompressed) body; say whether more was there."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        if size + len(chunk) > max_bytes:
            chunks.append(chunk[: max_bytes - size])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


# --- HTML to text -----------------------------------------------------------

_WHITESPACE = re.compile(r"\s+")

# Elements whose content is never document text.
# (Not <head>: its end tag is optional, and skipping an unclosed one would
# skip the whole page. <title> is read separately.)
SKIPPED_TAGS = {"script", "style", "noscript", "template", "svg"}
# Elements that end a line of text, so words on both sides are not glued.
BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt",
    "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4",
    "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p", "pre", "section",
    "table", "td", "th", "tr", "ul",
}  # fmt: skip


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title_parts: list[str] = []
        self.skip_depth = 0
        self.pre_depth = 0
        self.in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        # The document's title, not an <svg>'s <title> further down.
        if tag == "title" and self.skip_depth == 0 and not self.title_parts:
            self.in_title = True
        elif tag in SKIPPED_TAGS:
            self.skip_depth += 1
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")
            if tag == "pre":
                self.pre_depth += 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        # <br/>, <hr/>: a line break, and never an opening that needs closing.
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
        elif tag in SKIPPED_TAGS:
            self.skip_depth = max(0, self.skip_depth - 1)
        elif tag in BLOCK_TAGS:
            self.parts.append("\n")
            if tag == "pre":
                self.pre_depth = max(0, self.pre_depth - 1)

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title_parts.append(data)
        elif self.skip_depth == 0:
            # As in a browser, a line break in the source is just a space,
            # except in <pre>, where lines are the content.
            self.parts.append(data if self.pre_depth else _WHITESPACE.sub(" ", data))


def html_to_text(html: str) -> tuple[str, str]:
    """Return (title, text): tags, scripts and styles removed, whitespace collapsed.

    Line breaks are kept at block boundaries (paragraphs, headings, list
    items), because a model reads structured text better than one long line.
    """
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    title = " ".join("".join(parser.title_parts).split())
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    text = "\n".join(line for line in lines if line)
    return title, text
