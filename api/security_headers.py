"""The response headers every answer carries against framing, MIME sniffing and injected
content: `X-Frame-Options`, `Content-Security-Policy` (only this server's own scripts, styles
and images; no inline script; never framed) and `X-Content-Type-Options: nosniff`.

A pure ASGI middleware (a header list appended at `http.response.start`): it costs nothing per
request, unlike Starlette's `BaseHTTPMiddleware`, which would wrap every response body.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (
        b"content-security-policy",
        # Inline SVG charts are markup, not images: they need nothing more. `data:` images:
        # the stylesheet's own icons, if any.
        b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """Adds `SECURITY_HEADERS` to every HTTP response of `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)
