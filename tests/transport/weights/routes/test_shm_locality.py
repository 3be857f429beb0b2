"""Same-host shared memory is chosen by what matters, the same ``/dev/shm``, never by
host name: a worker under another host name that shares ``/dev/shm`` (a container on
the same kernel) takes the ``shm`` route; one with a ``/dev/shm`` of its own does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from transport.weights import WeightPublisher  # noqa: E402
from transport.weights.routes.shm import host_id  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

_SUBSCRIBER = textwrap.dedent(
    """
    import socket, sys, torch
    from transport.weights import WeightSubscriber
    from transport.weights.routes.shm import host_id

    print("HOST", socket.gethostname(), host_id(), flush=True)
    target = {"w": torch.zeros(4096)}
    with WeightSubscriber(sys.argv[1], target, worker_id="far", heartbeat_interval=0.1) as sub:
        ok = sub.wait_version(1, 60)
        print("APPLIED", ok, float(target["w"][0]), flush=True)
    """
)


def _namespaces_or_skip() -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1)")


def _update_through(namespace: str) -> tuple[str, list[str]]:
    """Publish one version to a subscriber started in ``namespace`` (a shell snippet run
    inside ``unshare -m -u`` before the subscriber); returns its route and output."""
    pub = WeightPublisher("tcp://127.0.0.1:*", shm=True, heartbeat_interval=0.1)
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
    cmd = f'{namespace} && exec "$0" -c "$1" "$2"'
    proc = subprocess.Popen(
        ["unshare", "-m", "-u", "sh", "-c", cmd, sys.executable, _SUBSCRIBER, pub.endpoint],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pub.wait_for_workers(1, 60)
        result = pub.publish_and_wait({"w": torch.full((4096,), 5.0)}, 1, timeout=60)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return result.paths["far"], out.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        pub.close()


@pytest.mark.slow
def test_other_host_name_same_dev_shm_takes_shm() -> None:
    _namespaces_or_skip()
    route, out = _update_through("hostname fastio-other-host")
    assert any(ln.startswith("HOST fastio-other-host ") for ln in out), out
    assert f"HOST fastio-other-host {host_id()}" in out  # the same id, another name
    assert "APPLIED True 5.0" in out
    assert route == "shm"


@pytest.mark.slow
def test_private_dev_shm_falls_back_to_tcp() -> None:
    _namespaces_or_skip()
    # A tmpfs of its own over /dev/shm, in the subscriber's mount namespace only: it
    # goes away with the process.
    route, out = _update_through("mount -t tmpfs -o size=16m fastio-test /dev/shm")
    (host,) = [ln for ln in out if ln.startswith("HOST ")]
    assert host.split()[2] != host_id()
    assert "APPLIED True 5.0" in out
    assert route == "tcp"


def test_host_id_names_the_boot_and_the_dev_shm_not_the_host_name() -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    st = os.stat("/dev/shm")
    assert host_id() == f"{boot}/{st.st_dev}:{st.st_ino}"
