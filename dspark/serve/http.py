"""uvicorn configured for dspark.serve: its h11 protocol, except that a client which shuts
down its sending side once the request is sent (a half-close) still gets the whole response.
asyncio closes a transport on EOF unless the protocol's eof_received returns True, and uvicorn's
returns None, so such a client would get at most the headers. A client that is really gone shows
when a write fails (connection_lost), which ends a stream and aborts its request."""
from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class HalfCloseH11Protocol(H11Protocol):
    def eof_received(self) -> bool:
        return True          # keep the transport open: the response still goes out


def config(app, **kwargs) -> uvicorn.Config:
    return uvicorn.Config(app, http=HalfCloseH11Protocol, **kwargs)
