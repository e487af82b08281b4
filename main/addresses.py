"""One server per address: `archway serve` refuses an address something already listens on.

gunicorn listens with SO_REUSEPORT (each worker has a socket of its own,
archway/server/worker.py), and the kernel lets sockets of the same user that all set it share an
address: a second `archway serve` on an address already served would silently take half its
connections, with another certificate; a program of the same user listening the same way would let gunicorn start and
then fail. So `archway serve` first binds the address itself WITHOUT SO_REUSEPORT, which fails with
EADDRINUSE whoever listens there, and says who that is: another archway (its GET /healthz
answers as archway's does) or another program. Two servers started in the same instant can
still both pass the probe: that race is left to whoever starts them. SO_REUSEADDR is set, as gunicorn sets it: the
TIME_WAIT connections of a server that just stopped do not count.
"""
import errno
import http.client
import json
import socket
import ssl

from archway.errors import ArchwayError
from archway.hostport import join_host_port
from archway.vocabulary import USER_AGENT

PROBE_SECONDS = 1.0


class AddressInUse(ArchwayError):
    """Something already listens on the address `archway serve` was asked to serve."""


def ensure_free(bind: str, host: str, port: int, what: str = "--bind") -> None:
    """Raise AddressInUse (or ArchwayError: not a local address, no permission) unless
    `host`:`port` can be listened on. `bind` is how the address was written, for the message."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ArchwayError(f"{what} {bind}: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            who = ("another archway server (it answers /healthz)" if answers_as_archway(host, port)
                   else "another program")
            raise AddressInUse(f"{what} {bind} is already in use by {who}: stop it, or serve "
                               f"on another address") from None
        if e.errno == errno.EACCES:
            raise ArchwayError(f"{what} {bind}: no permission to listen on port {port} (ports "
                               f"below 1024 need privileges)") from None
        raise ArchwayError(f"{what} {bind}: cannot listen there ({e.strerror})") from None
    finally:
        probe.close()


def answers_as_archway(host: str, port: int) -> bool:
    """Whether GET /healthz at the address answers as archway's does (its Server header, JSON status;
    HTTPS or HTTP, the certificate unchecked: nothing is sent but the request)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    for connection in (http.client.HTTPSConnection(target, port, timeout=PROBE_SECONDS,
                                                   context=insecure),
                       http.client.HTTPConnection(target, port, timeout=PROBE_SECONDS)):
        try:
            connection.request("GET", "/healthz", headers={"Host": join_host_port(target, port),
                                                           "User-Agent": USER_AGENT})
            answer = connection.getresponse()
            body = json.loads(answer.read(4096))
            return (answer.getheader("Server", "") == "archway"
                    and isinstance(body, dict) and body.get("status") in ("ok", "failing"))
        except (OSError, http.client.HTTPException, ValueError):
            continue
        finally:
            connection.close()
    return False
