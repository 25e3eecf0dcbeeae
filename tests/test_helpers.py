"""tests/helpers.py: wait_until returns the predicate's first truthy value, and fails with the message at the
deadline; free_port gives a port that can be bound."""
import socket

import pytest

from helpers import free_port, wait_until


def test_wait_until_returns_the_first_truthy_value_and_times_out_with_the_message():
    n = iter(range(10))
    assert wait_until(lambda: next(n) >= 3 and "yes", 2, 0.001) == "yes"
    with pytest.raises(AssertionError, match="timed out after 0.05 s: never"):
        wait_until(lambda: False, 0.05, 0.01, message=lambda: "never")


def test_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
