"""Agents enforce the generation rule themselves (issue #45), and nodes talk over TLS where the cluster has it.

Real `exod serve --cluster` daemons on a real etcd. An attacker who holds the cluster's token and reads the
controller's term in etcd replays spawns of a runner's earlier generation (and of a later one, and of the
same one), with the report streams it can guess and with one it opened itself: each agent refuses, from
what etcd holds at the spawn, and the processes on this machine and the keys in etcd show one generation
alive throughout. No refusal gives the term or the stream back. Over TLS (the CA of a secured etcd's, each
node's certificate naming its address) the nodes reach each other at https:// and verify each other; the
cluster's credential over plain HTTP, or from a peer without a certificate of the CA, is refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from etcd_harness import run_with_client
from reliability_report import cluster_fault
from test_cluster_nodes import hf_home as hf_home  # a fixture: the tiny model, 2 layers
from test_cluster_nodes import instance_at, nodes, start, stop_all, until

from daemon_harness import runner_pid, runner_pids
from exod.cluster.agent import BEAT_S, NOT_OBEYED, Refused
from exod.cluster.devcluster import cluster_token_file
from exod.cluster.election import TERM_HEADER, election_key
from exod.cluster.membership import DEFAULT_PREFIX
from exod.cluster.nodes import live_runners, runner_key
from exod.cluster.token import HEADER, read_token

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

PREFIX = DEFAULT_PREFIX.encode()
TTL = 10  # no node dies here: a lease long enough that a busy machine's slow renewal deposes no one


def etcd_view(etcd: str, security=None) -> tuple[int, dict[str, set[tuple[str, int]]]]:
    """What anyone who can read etcd sees: the controller's term (the election key's create revision) and
    every runner key, by node."""

    async def read(client):
        holder = await client.get(election_key(PREFIX))
        return (0 if holder is None else holder.create_revision), await live_runners(client, PREFIX)

    return run_with_client(etcd, read, security=security)


def incarnations() -> list[int]:
    """The incarnation of every runner process alive on this machine, read from its command line."""
    found = []
    for pid in runner_pids():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        found.append(int(args[args.index(b"--incarnation") + 1]))
    return sorted(found)


def spawn_body(iid: str, incarnation: int, stream: int) -> dict:
    """A spawn as the controller sends it (`exod.cluster.remote.RemoteProcess`), of rank 0 of a world of one."""
    body = {"instance_id": iid, "runner_id": f"{iid}/0", "incarnation": incarnation, "rank": 0, "world_size": 1}
    return body | {"ring": [], "stream": stream}


KINDS = {  # what each refusal of a replayed spawn says, by the rule that refused it
    "an earlier generation": "an earlier generation still holds runner keys in etcd",
    "is stale or runs already": "a later generation's key (or its own) is in etcd",
    "is older than generation": "older than a generation this node ran",
    NOT_OBEYED: "not of the term and report stream obeyed",
}


def kind(message: str) -> str:
    return next(what for key, what in KINDS.items() if key in message)


def test_a_replayed_spawn_of_another_generation_is_refused_by_the_agent_and_never_runs(tmp_path, etcd, hf_home):
    """Issue #45's attack: generation 2 of an instance runs on node-2; spawns of generations 1, 2, 3 and 5 are
    replayed to both nodes with the cluster token and etcd's term."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, 1, env, TTL)]
    try:
        until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] == "node-1", 30)
        daemons.append(start(tmp_path, etcd, 2, env, TTL))
        first, second = daemons[0][1], daemons[1][1]
        until(lambda: nodes(first), lambda v: len(v["nodes"]) == 2, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": 1, "nodes": ["node-2"]}
        iid = httpx.post(f"{first}/instances", json=body, timeout=30).json()["instance_id"]
        until(lambda: instance_at(first, iid), lambda i: i["state"] == "ready", 60)
        os.kill(runner_pid(0), signal.SIGKILL)  # generation 1 dies: the controller starts generation 2
        until(lambda: instance_at(first, iid), lambda i: i["state"] == "ready" and i["generation"] == 2, 60)
        term, keys = etcd_view(etcd)
        assert keys == {"node-2": {(f"{iid}/0", 2)}} and incarnations() == [2]

        token = read_token(cluster_token_file(tmp_path))
        headers = {HEADER: token, TERM_HEADER: str(term)}  # the term as etcd holds it: the attacker's best
        refusals: list[tuple[int, str]] = []
        watched: list[tuple[list[int], dict]] = []  # every look from outside: processes, and keys in etcd

        def replay(url: str, incarnation: int, stream: int, term_sent: int = term) -> int:
            sent = {**headers, TERM_HEADER: str(term_sent)}
            answer = httpx.post(f"{url}/agent/runners", json=spawn_body(iid, incarnation, stream), headers=sent)
            refusals.append((answer.status_code, answer.json()["error"]["message"]))
            watched.append((incarnations(), etcd_view(etcd)[1]))
            return answer.status_code

        # as in the issue: the term known, the stream guessed (no 409 tells it any more)
        guessed = [replay(url, gen, stream) for url in (first, second) for gen in (1, 3, 5) for stream in (1, 2, 3)]
        # stronger: a report stream of its own on node-1 (the current term opens one), and its number; on node-1,
        # whose agent runs nothing, it takes no runner down (on node-2 it would stop generation 2: DESIGN §5)
        with httpx.stream("GET", f"{first}/agent/reports", headers=headers, timeout=10) as reports:
            assert reports.status_code == 200
            lines = reports.iter_lines()  # kept: a generator dropped closes the response
            stream = json.loads(next(lines))["stream"]
            own = {gen: replay(first, gen, stream) for gen in (1, 2, 3)}  # earlier, the same, later
            wrong_term = [replay(first, 3, stream, term_sent) for term_sent in (term - 1, term + 1)]
        time.sleep(2 * BEAT_S)  # a spawn taken would have its process by now, and its key
        after = instance_at(first, iid)
        final = (incarnations(), etcd_view(etcd)[1])

        assert set(guessed) == {409} and own == {1: 409, 2: 409, 3: 409} and wrong_term == [409, 409]
        assert all((gens, found) == ([2], {"node-2": {(f"{iid}/0", 2)}}) for gens, found in [*watched, final])
        assert (after["state"], after["generation"]) == ("ready", 2)
        for _, message in refusals:  # what to do, and the keys in the way: no other number, term or stream
            rest = re.sub(rf"{re.escape(iid)}/0/\d( on node-2)?|generation \d", "", message).replace(iid, "")
            assert not re.search(r"\d", rest.replace("node-2", "")), message
        kinds = Counter(kind(message) for _, message in refusals)
        by_generation = {gen: kind(message) for gen, (_, message) in zip((1, 2, 3), refusals[-5:-2], strict=True)}
        assert by_generation == {
            1: KINDS["is stale or runs already"],  # node-1 never ran it: etcd's key of generation 2 refuses it
            2: KINDS["is stale or runs already"],  # the same rank of the same generation runs on node-2
            3: KINDS["an earlier generation"],  # generation 2 still holds its key
        }
        assert kind(refusals[-1][1]) == kind(refusals[-2][1]) == KINDS[NOT_OBEYED]
        said = ", ".join(f"{count} {what}" for what, count in kinds.items())
        cluster_fault(
            "replayed spawn",
            f"{len(refusals)} spawns of generations 1, 2, 3 and 5 beside the live generation 2, with the cluster "
            f"token and etcd's term, on guessed streams and on a stream the attacker opened: {len(refusals)} x 409 "
            f"({said}); no message with the term or a stream; runner processes of generation(s) {final[0]} and "
            f"etcd's runner keys {sorted(final[1]['node-2'])} at each of {len(watched) + 1} looks from outside",
        )
    finally:
        stop_all(daemons)
    assert runner_pids() == []


# -- the claim, against a fake etcd on trio's MockClock (`test_agent`'s): what only timing can show ------------


def test_a_spawn_names_the_term_etcd_holds_at_the_claim_not_the_one_the_agent_last_saw(tmp_path):
    """The election key changed hands a moment ago: the agent's stream is still of the old term (it reads etcd
    once a beat), but its claim compares the key in etcd itself, so the old term's spawn starts nothing."""
    from test_agent import TERM, request, with_agent

    async def body(agent, etcd, presence, processes):
        etcd.term = TERM + 1  # elected anew; `_follow_term` has not looked yet
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM, request())
        assert (refused.value.status, refused.value.detail) == (409, NOT_OBEYED)
        assert processes == [] and etcd.keys == {}

    with_agent(tmp_path, body)


def test_a_claim_is_one_transaction_with_its_check_a_rivals_claim_between_them_is_seen(tmp_path):
    """Between the agent's read of the runner keys and its write, another node claims generation 2 of the same
    instance: the write compares the keys as read, fails, and the read again refuses the stale generation 1."""
    from test_agent import PREFIX, TERM, request, with_agent

    rival = runner_key(PREFIX, "node-1", "i/1", 2)

    async def body(agent, etcd, presence, processes):
        read = etcd.get_prefix

        async def then_a_rival_claims(prefix):
            answer = await read(prefix)
            if prefix.endswith(b"runners/") and rival not in etcd.keys:
                await etcd.put(rival, b"", lease=9)  # lands after the read, before the agent's write
            return answer

        etcd.get_prefix = then_a_rival_claims
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM, request())
        assert refused.value.status == 409 and "i/1/2 on node-1" in refused.value.detail
        assert processes == [] and list(etcd.keys) == [rival]
        with pytest.raises(Refused, match="older than generation 2"):  # this node has seen it now
            await agent.spawn(TERM, request())

    with_agent(tmp_path, body)


# -- TLS between nodes -------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> Path:
    """A CA of its own (``ca.crt``, ``ca.key``) in ``directory``."""
    directory.mkdir(exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN={name}", "-days", "2",
             cwd=directory)  # fmt: skip
    return directory / "ca.crt"


def node_certificate(pki: Path, name: str, address: str, ca: str = "ca") -> tuple[Path, Path]:
    """A node's certificate and key, signed by ``ca`` in ``pki``: its address in subjectAltName, usable as a
    server and as a client (what `exod.cluster.tls` asks for)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=pki)
    (pki / f"{name}.ext").write_text(f"subjectAltName=IP:{address}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=pki)  # fmt: skip
    (pki / f"{name}.key").chmod(0o600)
    return pki / f"{name}.crt", pki / f"{name}.key"


def trusting(ca: Path, certificate: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """An HTTP client's TLS: it trusts ``ca``, and shows ``certificate`` (and its key) if given. (httpx's own
    ``cert=`` is dropped when ``verify`` is a path.)"""
    context = ssl.create_default_context(cafile=str(ca))
    if certificate is not None:
        context.load_cert_chain(*map(str, certificate))
    return context


def test_nodes_talk_over_tls_with_etcds_ca_and_refuse_a_plain_or_foreign_peer(tmp_path, secure_etcd, hf_home):
    """The CA of the secured etcd (`secure_etcd` made it under ``tmp_path/pki``) signs each node's certificate."""
    pki = tmp_path / "pki"
    s = secure_etcd.security
    etcd_lines = (
        f'etcd_ca = "{s.ca}"\netcd_cert = "{s.cert}"\netcd_key = "{s.key}"\n'
        f'etcd_user = "root"\netcd_password_file = "{secure_etcd.password_file}"\n'
    )
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = []
    try:
        for n in (1, 2):
            cert, key = node_certificate(pki, f"node-{n}", f"127.0.0.{n}")
            extra = etcd_lines + f'tls_cert = "{cert}"\ntls_key = "{key}"\n'  # tls_ca: etcd_ca
            daemons.append(start(tmp_path, secure_etcd.url, n, env, TTL, extra_cluster=extra))
            if n == 1:
                until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] == "node-1", 30)
        first, second = daemons[0][1], daemons[1][1]
        until(lambda: nodes(first), lambda v: len(v["nodes"]) == 2, 30)
        # placed through node-2, which forwards it to the controller (node-1), which drives node-2's agent
        body = {"model": "exod/tiny-qwen2", "ranks": 1, "nodes": ["node-2"]}
        placed = httpx.post(f"{second}/instances", json=body, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        ready = until(lambda: instance_at(first, iid), lambda i: i["state"] == "ready", 60)
        assert [r["node"] for r in ready["runners"]] == ["node-2"]

        token = read_token(cluster_token_file(tmp_path))
        agent = "/agent/ports?count=1"
        secured = second.replace("http://", "https://")
        plain = httpx.post(f"{second}{agent}", headers={HEADER: token}, timeout=10)
        forwarded_plain = httpx.post(f"{second}/instances", json=body, headers={HEADER: token}, timeout=10)
        with httpx.Client(verify=trusting(s.ca), timeout=10) as anonymous:  # TLS, but no certificate of its own
            no_certificate = anonymous.post(f"{secured}{agent}", headers={HEADER: token})
            health = anonymous.get(f"{secured}/health")  # a client of the API needs none
        foreign = make_ca(tmp_path / "foreign", "another-ca")
        stranger = node_certificate(foreign.parent, "stranger", "127.0.0.2")
        with (
            httpx.Client(verify=trusting(s.ca, stranger), timeout=10) as impostor,
            pytest.raises(httpx.TransportError) as handshake,  # TLS 1.3: said at the first read
        ):
            impostor.post(f"{secured}{agent}", headers={HEADER: token})
        peer = node_certificate(pki, "peer", "127.0.0.1")
        with httpx.Client(verify=trusting(s.ca, peer), timeout=10) as node:
            certified = node.post(f"{secured}{agent}", headers={HEADER: token})
        with (
            httpx.Client(verify=trusting(foreign), timeout=10) as fooled,  # the server's certificate is checked too
            pytest.raises(httpx.ConnectError) as unverified,
        ):
            fooled.get(f"{secured}/health")

        assert [plain.status_code, forwarded_plain.status_code, no_certificate.status_code] == [403] * 3
        assert "TLS" in plain.json()["error"]["message"] and health.status_code == 200
        assert isinstance(handshake.value, httpx.RemoteProtocolError | httpx.ReadError)  # no answer: hung up on
        assert "CERTIFICATE_VERIFY_FAILED" in str(unverified.value)
        assert certified.status_code == 200 and certified.json()["address"] == "127.0.0.2"
        assert instance_at(first, iid)["state"] == "ready"  # none of it disturbed the runner
        refused = (tmp_path / "node-2" / "serve.log").read_text()
        assert "TLS handshake refused" in refused and "certificate verify failed" in refused  # the operator's why
    finally:
        stop_all(daemons)
    assert runner_pids() == []


def test_a_node_whose_certificate_does_not_name_its_address_is_refused_at_start_saying_why(tmp_path, etcd):
    ca = make_ca(tmp_path / "pki", "exod-test-ca")
    cert, key = node_certificate(ca.parent, "elsewhere", "127.0.0.9")
    home = tmp_path / "node-1"
    home.mkdir()
    token = cluster_token_file(tmp_path)
    config = f'[cluster]\nurl = "{etcd}"\nnode_id = "node-1"\nadvertise = "127.0.0.1"\ntoken_file = "{token}"\n'
    config += f'tls_ca = "{ca}"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
    (home / "exod.toml").write_text(config)
    args = ["serve", "--config", str(home / "exod.toml"), "--state-dir", str(home / "state"), "--port", "0"]
    run = subprocess.run([sys.executable, "-m", "exod", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "IP address mismatch" in run.stderr and "subjectAltName" in run.stderr
    assert not (home / "state" / "daemon.json").exists()
