"""Name lookups end at the caller's deadline (registry/dns.py): a resolver that stops answering
cannot hold an image lookup past its deadline, at the host check or at the connection.

The silent resolver is fault injection (no test can make the machine's DNS stop answering):
a getaddrinfo that blocks until released, counting its calls. The registry is a real one."""
import socket
import threading
import time

import pytest

from archway.config import RegistrySettings
from archway.errors import DeadlineExceeded
from archway.registry import dns
from archway.registry.credentials import Keyring
from archway.registry.dns import LookupTimeout, NameLookups
from archway.registry.hostpolicy import HostPolicy
from archway.registry.http import HttpClient
from archway.registry.oci import RegistryClient
from archway.registry.reference import parse_reference
from lab.procs import wait_until
from tests.infra.fixtures import plain_registry


class SilentResolver:
    """getaddrinfo for `silent` names blocks until release(); others resolve for real."""

    def __init__(self, *silent: str):
        self.silent = set(silent)
        self.calls: list[str] = []
        self.released = threading.Event()

    def __call__(self, host, port, *args):
        self.calls.append(host)
        if host in self.silent:
            self.released.wait(30)
        return socket.getaddrinfo(host, port, *args)

    def release(self):
        self.released.set()


def test_a_lookup_that_never_answers_ends_at_the_deadline():
    silent = SilentResolver("localhost")
    lookups = NameLookups(silent)
    started = time.monotonic()
    with pytest.raises(LookupTimeout, match="localhost"):
        lookups.getaddrinfo("localhost", 443, deadline=started + 0.3)
    assert 0.3 <= time.monotonic() - started < 1.5
    silent.release()


def test_callers_of_one_name_share_the_lookup_in_flight():
    silent = SilentResolver("localhost")
    lookups = NameLookups(silent)
    answers, errors, entered = [], [], []

    def caller():
        entered.append(1)
        try:
            answers.append(lookups.getaddrinfo("localhost", 443, proto=socket.IPPROTO_TCP,
                                               deadline=time.monotonic() + 10))
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=caller) for _ in range(20)]
    for t in threads:
        t.start()
    # Released once every caller waits on the one lookup (a caller still on its way when the
    # answer came would start a second one): the lookup's Event counts its waiters.
    def waiting() -> int:
        return sum(len(lookup.done._cond._waiters)  # type: ignore[attr-defined]
                   for lookup in list(lookups._in_flight.values()))
    wait_until(lambda: len(entered) == len(threads) and waiting() == len(threads), 10,
               "every caller to wait on the one lookup")
    silent.release()
    for t in threads:
        t.join(5)
    assert silent.calls == ["localhost"] and errors == [] and len(answers) == 20
    assert all(answer == answers[0] for answer in answers)
    # Nothing is kept once answered: the next caller looks the name up again.
    lookups.getaddrinfo("localhost", 443, proto=socket.IPPROTO_TCP, deadline=time.monotonic() + 5)
    assert silent.calls == ["localhost", "localhost"]


def test_a_failed_lookup_is_each_callers_own_error():
    def unknown(host, port, *args):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    lookups = NameLookups(unknown)
    raised = []
    for _ in range(2):
        with pytest.raises(socket.gaierror) as caught:
            lookups.getaddrinfo("nowhere.invalid", 443, deadline=time.monotonic() + 5)
        raised.append(caught.value)
    assert raised[0] is not raised[1] and raised[0].args == (socket.EAI_NONAME,
                                                             "Name or service not known")


def test_addresses_and_callers_without_a_deadline_do_not_need_a_thread():
    calls = []

    def counting(host, port, *args):
        calls.append(threading.current_thread().name)
        return socket.getaddrinfo(host, port, *args)
    lookups = NameLookups(counting)
    lookups.getaddrinfo("127.0.0.1", 80, deadline=time.monotonic() + 5)
    lookups.getaddrinfo("localhost", 80)
    assert calls == [threading.current_thread().name] * 2


# --- through the registry client, against a real registry -----------------------------------

def _client(netloc, policy=None) -> RegistryClient:
    settings = RegistrySettings(insecure_hosts=(netloc,))
    return RegistryClient(HttpClient(settings, policy=policy), settings)


def _lookup(client, netloc, seconds):
    return client.resolve(parse_reference(f"{netloc}/team/app:v1"), Keyring.empty(),
                          time.monotonic() + seconds)


@pytest.mark.slow
def test_a_silent_resolver_at_the_host_check_ends_the_lookup_at_its_deadline(
        plain_registry, monkeypatch):
    plain_registry.push_image("team/app", "v1", "linux/amd64")
    netloc = f"localhost:{plain_registry.port}"
    assert _lookup(_client(netloc), netloc, 10).platforms   # the name resolves, the image is there
    silent = SilentResolver("localhost")
    monkeypatch.setattr(dns.LOOKUPS, "_getaddrinfo", silent)
    mark = plain_registry.mark()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="DNS lookup of localhost"):
        _lookup(_client(netloc), netloc, 0.5)
    assert time.monotonic() - started < 2.0
    assert plain_registry.requests_since(mark) == []
    silent.release()


@pytest.mark.slow
def test_a_silent_resolver_at_the_connection_ends_the_lookup_at_its_deadline(
        plain_registry, monkeypatch):
    """The host check saw the name answer; the connection's own lookup does not."""
    plain_registry.push_image("team/app", "v1", "linux/amd64")
    netloc = f"localhost:{plain_registry.port}"
    checked = HostPolicy(resolve=socket.getaddrinfo)
    silent = SilentResolver("localhost")
    monkeypatch.setattr(dns.LOOKUPS, "_getaddrinfo", silent)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        _lookup(_client(netloc, checked), netloc, 0.5)
    assert time.monotonic() - started < 2.0 and silent.calls == ["localhost"]
    silent.release()
    # The resolver answers again: so does the registry, through the same kind of client.
    assert _lookup(_client(netloc, checked), netloc, 10).platforms
