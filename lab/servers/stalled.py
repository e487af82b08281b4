"""Clients that open a connection to an HTTPS server, send part of what they should, and stall.

The shapes an attack run used against `archway serve` (issue 16): each holds its socket open
until the server closes it. Used by tests/test_hostile_clients.py and bench/sections/slowclients.py.

    s = stalled(("127.0.0.1", port), "client_hello", tls_context, body)
    still_open(s)   # False once the server has closed (or reset) it
"""
import os
import socket
import ssl

# kind -> what the client sends before it stalls
KINDS = {
    "idle": "nothing (a bare TCP connection)",
    "client_hello": "3 bytes of a TLS ClientHello",
    "request_line": "after the TLS handshake, half a request line",
    "body": "after the TLS handshake, a request head and 100 bytes of its body",
}


def stalled(address: tuple[str, int], kind: str, tls: ssl.SSLContext, body: bytes,
            path: str = "/mutate") -> socket.socket:
    raw = socket.create_connection(address, timeout=30)
    if kind == "idle":
        return raw
    if kind == "client_hello":
        raw.sendall(b"\x16\x03\x01")
        return raw
    s = tls.wrap_socket(raw, server_hostname=address[0])
    if kind == "request_line":
        s.sendall(f"POST {path[:3]}".encode())
    elif kind == "body":
        s.sendall(request_head(path, len(body)) + body[:100])
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return s


def request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: archway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def still_open(s: socket.socket) -> bool:
    """Whether the server has not closed the connection yet; never blocks, reads nothing."""
    peek = socket.socket(fileno=os.dup(s.fileno()))
    try:
        return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False   # reset
    finally:
        peek.close()
