"""Runs a scenario of ``scenarios.py`` in N rank processes, with a hard timeout.

Each rank is a fresh ``python rank_main.py`` process (its own session, so a timeout kills it
and anything it started). Ranks rendezvous through a FileStore in a temporary directory and
write their results as JSON; the launcher never waits longer than ``timeout`` seconds.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_MAIN = os.path.join(HERE, "rank_main.py")


class RankFailure(AssertionError):
    pass


def rank_env(extra=None):
    env = dict(os.environ)
    # A safety net: an operation that makes no progress for this long fails in the library.
    env.setdefault("COMM_TIMEOUT", "60")
    env.setdefault("COMM_INIT_TIMEOUT", "60")
    # gloo (the reference backend) over loopback, whatever the host name resolves to.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def run(scenario, world, timeout=150, env=None, args=(), expect_exit=None, hosts=None):
    """Runs ``scenario`` on ``world`` ranks; returns the list of per-rank results.

    ``expect_exit`` maps ranks to the exit code they are meant to end with (a rank that
    kills itself); every other rank must exit 0. ``hosts``, a pair (``Hosts``, host of each
    rank), starts each rank inside its simulated host (see ``Hosts``).
    """
    expect_exit = dict(expect_exit or {})
    tmp = tempfile.mkdtemp(prefix=f"comm-test-{scenario}-")
    store = os.path.join(tmp, "store")
    procs, logs = [], []
    environment = rank_env(env)
    for rank in range(world):
        # Open until the ranks are collected below (each rank writes to it, then it is read).
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115
        cmd = [sys.executable, RANK_MAIN, scenario, str(rank), str(world), store, os.path.join(tmp, f"rank{rank}.json")]
        cmd += [str(a) for a in args]
        if hosts is not None:
            cmd = hosts[0].exec_prefix(hosts[1][rank]) + cmd
        procs.append(
            subprocess.Popen(cmd, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        logs.append(log)
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    if timed_out:
        # SIGABRT first: faulthandler (PYTHONFAULTHANDLER) prints every thread's stack into the
        # rank's log, which says where it hung.
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
        time.sleep(2)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

    def tails():
        out = []
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            out.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{text[-6000:]}")
        return f"(logs in {tmp})\n" + "\n".join(out)

    if timed_out:
        raise RankFailure(f"scenario {scenario!r} on {world} ranks did not finish in {timeout}s\n{tails()}")
    for rank, p in enumerate(procs):
        want = expect_exit.get(rank, 0)
        if p.returncode != want:
            raise RankFailure(
                f"scenario {scenario!r}: rank {rank} exited with {p.returncode}, expected {want}\n{tails()}"
            )
    results = []
    for rank in range(world):
        path = os.path.join(tmp, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    for log in logs:
        log.close()
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when a rank failed, for its logs
    return results


class Hosts:
    """Simulated hosts made by ``scripts/netns.sh`` (network namespaces with their own PID,
    IPC and mount namespaces, linked only by veth pairs and a bridge); removed on ``close``.
    Needs root and iproute2: ``Hosts.available()`` says why not, where they are missing."""

    SCRIPT = os.path.join(HERE, "..", "..", "scripts", "netns.sh")

    def __init__(self, n):
        self.prefix = f"cpy{os.getpid() % 100000}x{n}"
        self.n = n
        subprocess.run([self.SCRIPT, "down", self.prefix], check=False)
        subprocess.run([self.SCRIPT, "up", self.prefix, str(n)], check=True)

    @staticmethod
    def available():
        if os.geteuid() != 0:
            return "simulated hosts need root"
        if shutil.which("ip") is None or shutil.which("nsenter") is None:
            return "simulated hosts need iproute2 and util-linux (ip, nsenter)"
        return None

    def addr(self, i):
        return f"10.77.0.{i + 1}"

    def exec_prefix(self, i):
        return [self.SCRIPT, "exec", self.prefix, str(i)]

    def close(self):
        subprocess.run([self.SCRIPT, "down", self.prefix], check=False)


def failed_checks(results, name):
    """Tracebacks of check ``name`` on every rank that reported it failing."""
    bad = []
    for rank, res in enumerate(results):
        if res is None:
            continue
        value = res.get("checks", {}).get(name)
        if value is None:
            bad.append(f"rank {rank}: check {name!r} did not run")
        elif value != "ok":
            bad.append(f"rank {rank}:\n{value}")
    return bad


def run_command(cmd, timeout, env=None):
    """subprocess.run for one command in its own session: on timeout the whole process group
    (with anything the command started) is killed, and the test fails."""
    proc = subprocess.Popen(
        cmd, env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RankFailure(f"{cmd[:4]} did not finish in {timeout}s\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
