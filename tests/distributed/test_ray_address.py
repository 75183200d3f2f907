"""`deploy.ray_address` in a process already attached to a Ray cluster (the tests' shared one):
an address naming another cluster is refused with one line, never silently ignored."""

import socket

import pytest

from rlfusion.errors import RunError
from rlfusion.runtime.ray_devices import check_attached


def test_an_address_other_than_the_attached_cluster_is_refused(ray_session):
    import ray

    check_attached(ray, "")  # no address: the attached cluster
    check_attached(ray, ray_session)  # its own address
    with socket.socket() as idle:  # a loopback port nothing listens on
        idle.bind(("127.0.0.1", 0))
        port = idle.getsockname()[1]
    with pytest.raises(RunError, match="no Ray cluster answers there"):
        check_attached(ray, f"127.0.0.1:{port}")
    with socket.socket() as other:  # something listens there, but it is not this cluster
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(RunError, match="already attached to the Ray cluster at"):
            check_attached(ray, f"127.0.0.1:{other.getsockname()[1]}")
