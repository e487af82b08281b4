"""Name lookups that end at the caller's deadline.

getaddrinfo cannot be interrupted: a resolver that does not answer holds its caller for the
system's timeout x attempts x nameservers (resolv.conf's defaults: 5 s x 2 x up to 3), whatever
deadline the request had. Here a lookup runs on a thread of its own and the caller waits until
its deadline, not longer. Callers of the same name share the lookup in flight, so a resolver
that stopped answering costs one thread per name, not one per request.
"""
import ipaddress
import os
import socket
import threading
import time

from archway.errors import ArchwayError


class LookupTimeout(ArchwayError, TimeoutError):
    """The name did not resolve by the caller's deadline."""


class _Lookup:
    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: list = []
        self.error: BaseException | None = None


class NameLookups:
    def __init__(self, getaddrinfo=socket.getaddrinfo):
        self._getaddrinfo = getaddrinfo
        self._lock = threading.Lock()
        self._in_flight: dict[tuple, _Lookup] = {}
        self._pid = os.getpid()

    def getaddrinfo(self, host: str, port, family: int = 0, socktype: int = 0, proto: int = 0,
                    flags: int = 0, *, deadline: float | None = None) -> list:
        """socket.getaddrinfo, raising LookupTimeout at `deadline` (time.monotonic())."""
        args = (host, port, family, socktype, proto, flags)
        if deadline is None or _is_address(host):
            return self._getaddrinfo(*args)
        with self._lock:
            if self._pid != os.getpid():   # a forked worker: the lookup threads are not here
                self._pid, self._in_flight = os.getpid(), {}
            lookup = self._in_flight.get(args)
            if lookup is None:
                lookup = self._in_flight[args] = _Lookup()
                threading.Thread(target=self._run, args=(args, lookup), name="archway-dns",
                                 daemon=True).start()
        if not lookup.done.wait(max(0.0, deadline - time.monotonic())):
            raise LookupTimeout(f"the DNS lookup of {host} did not answer in time")
        if lookup.error is not None:
            raise _copy(lookup.error)
        return lookup.result

    def _run(self, args: tuple, lookup: _Lookup) -> None:
        try:
            lookup.result = self._getaddrinfo(*args)
        except Exception as e:   # gaierror, UnicodeError for a bad name: the caller's to see
            lookup.error = e
        finally:
            with self._lock:
                if self._in_flight.get(args) is lookup:
                    del self._in_flight[args]
            lookup.done.set()


def _copy(error: BaseException) -> BaseException:
    """A new exception per caller: raising one shared object from several threads would chain
    their tracebacks onto it."""
    try:
        return type(error)(*error.args)
    except Exception:
        return error


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
        return True
    except ValueError:
        return False


LOOKUPS = NameLookups()
