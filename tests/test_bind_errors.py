"""`radixserve serve` bind errors: the hint names what to fix (--host or --port) for the cause."""

from __future__ import annotations

import errno
import logging
import os
import socket

from radixserve.config import Config
from radixserve.server.launch import bind_error_message, listen_socket


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def test_unresolvable_host_gets_a_host_hint(caplog):
    config = Config.build({"server": {"host": "999.1.1.1", "port": 18756}})
    with caplog.at_level(logging.ERROR, logger="radixserve.server"):
        assert listen_socket(config) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("cannot listen on 999.1.1.1:18756: ")
    assert "--host" in line and "--port" not in line, line


def test_gaierror_is_about_the_host_even_when_its_code_is_an_errno():
    # EAI_* codes are small negative (or, elsewhere, positive) numbers that may equal an errno's
    e = socket.gaierror(errno.EADDRINUSE, "Name or service not known")
    msg = bind_error_message("nosuch.invalid", 80, e)
    assert msg.startswith("cannot listen on nosuch.invalid:80: Name or service not known (")
    assert "--host" in msg and "--port" not in msg


def test_address_not_on_this_machine_gets_a_host_hint():
    msg = bind_error_message("10.255.255.1", 18756, _os_error(errno.EADDRNOTAVAIL))
    assert msg.startswith("cannot listen on 10.255.255.1:18756: Cannot assign requested address (")
    assert "is --host an address of this machine?" in msg and "--port" not in msg


def test_busy_port_keeps_the_port_hint():
    msg = bind_error_message("127.0.0.1", 18756, _os_error(errno.EADDRINUSE))
    assert msg == ("cannot listen on 127.0.0.1:18756: Address already in use "
                   "(another server on that port? pick one with --port)")


def test_other_errors_get_no_wrong_hint():
    assert "another server" not in bind_error_message("127.0.0.1", 80, _os_error(errno.EACCES))
    assert bind_error_message("127.0.0.1", 8080, _os_error(errno.EINVAL)) == (
        "cannot listen on 127.0.0.1:8080: Invalid argument")
