"""etcd as its operator secures it (`exod.cluster.etcd.EtcdSecurity`, issue #25): TLS with the cluster's CA and
a client certificate, and etcd's own authentication. Against a real etcd started that way (`secure_etcd`)."""

from __future__ import annotations

import attrs
import pytest
from etcd_harness import run_with_client

from exod.cluster.etcd import EtcdError, EtcdSecurity, EtcdUnavailable


async def write_and_read(client):
    await client.put(b"/exod-test/k", b"v")
    return (await client.get(b"/exod-test/k")).value


def test_with_the_ca_a_certificate_and_a_user_every_call_goes_through(secure_etcd):
    assert run_with_client(secure_etcd.url, write_and_read, security=secure_etcd.security) == b"v"


def test_without_the_clusters_ca_or_a_client_certificate_or_a_user_nothing_does(secure_etcd):
    no_ca = attrs.evolve(secure_etcd.security, ca=None)
    no_cert = EtcdSecurity(ca=secure_etcd.security.ca, user="root", password="s3cret-for-root")
    no_user = attrs.evolve(secure_etcd.security, user=None, password="")
    wrong = attrs.evolve(secure_etcd.security, password="guess")
    with pytest.raises(EtcdUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        run_with_client(secure_etcd.url, write_and_read, security=no_ca)
    with pytest.raises(EtcdUnavailable):  # the member asks for a certificate of its CA: the handshake fails
        run_with_client(secure_etcd.url, write_and_read, security=no_cert)
    with pytest.raises(EtcdError, match=r"user name is empty|permission denied|token"):
        run_with_client(secure_etcd.url, write_and_read, security=no_user)
    with pytest.raises(EtcdError, match="authentication failed"):
        run_with_client(secure_etcd.url, write_and_read, security=wrong)


def test_a_token_etcd_no_longer_takes_is_asked_for_again(secure_etcd):
    async def body(client):
        await write_and_read(client)
        client._token = "an-expired-token"  # as after a restart of the member, or a token of another member
        return await write_and_read(client)

    assert run_with_client(secure_etcd.url, body, security=secure_etcd.security) == b"v"
