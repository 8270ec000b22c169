"""Shared fixtures for the Python client tests of the simulated driver.

The simulated libraries are built once per session with ``cargo xtask sim`` into
``<repo>/target/cuda-sim`` (set ``VGPU_SIM_PREBUILT=1`` to use what is there). Every
test gets a fresh node (its own ``VGPU_SIM_DIR``), and client code runs in
subprocesses so that ``LD_LIBRARY_PATH`` applies when they load ``libcuda.so.1`` and
``libnvidia-ml.so.1``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Where cargo builds: $CARGO_TARGET_DIR (relative to the repository root), else target/.
TARGET = REPO / os.environ.get("CARGO_TARGET_DIR", "target")
SIM_LIBS = TARGET / "cuda-sim"
VGPU_SIM = TARGET / "release" / "vgpu-sim"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def sim_libs():
    """The directory holding the simulated libcuda and libnvidia-ml."""
    if os.environ.get("VGPU_SIM_PREBUILT") != "1":
        subprocess.run(["cargo", "xtask", "sim"], cwd=REPO, check=True)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        assert (SIM_LIBS / name).exists(), f"{SIM_LIBS / name} missing: run `cargo xtask sim`"
    return SIM_LIBS


class SimNode:
    """A fresh simulated node, and ways to run clients on it."""

    def __init__(self, libs, state_dir):
        self.dir = state_dir
        self.env = dict(os.environ)
        self.env.pop("VGPU_SIM_CONFIG", None)
        self.env["VGPU_SIM_DIR"] = str(state_dir)
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(libs)] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        )
        self.procs = []

    def configure(self, toml_text):
        """Gives the node a simulator config (before anything has used the node)."""
        assert not self.dir.exists(), "configure the node before using it"
        path = self.dir.parent / "vgpu-sim.toml"
        path.write_text(toml_text)
        self.env["VGPU_SIM_CONFIG"] = str(path)

    def run(self, *cmd, timeout=60, check=True):
        """Runs a command on the node; returns the CompletedProcess."""
        r = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"{cmd} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
            )
        return r

    def python(self, code, **kw):
        """Runs Python code in a fresh interpreter on the node; returns its stdout."""
        return self.run(sys.executable, "-c", textwrap.dedent(code), **kw).stdout

    def vgpu_sim(self, *args):
        """Runs the simulator's fault-injection CLI."""
        assert VGPU_SIM.exists(), f"{VGPU_SIM} missing: run `cargo xtask sim`"
        return self.run(str(VGPU_SIM), *args).stdout

    def spawn(self, *cmd):
        """Starts a long-running process on the node (killed at teardown)."""
        p = subprocess.Popen(
            list(cmd), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(p)
        return p

    def gpu_process(self, nbytes, busy=False, device=0):
        """Starts a CUDA program holding ``nbytes`` on GPU ``device``; returns
        (proc, free, total) as the driver reported them to it after its allocation."""
        args = [sys.executable, str(HERE / "gpu_process.py"), str(nbytes), f"dev={device}"]
        args += ["busy"] if busy else []
        p = self.spawn(*args)
        line = p.stdout.readline()
        if not line.startswith("READY"):
            p.kill()
            raise AssertionError(f"gpu process failed: {line}{p.stderr.read()}")
        _, free, total = line.split()
        return p, int(free), int(total)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def node(sim_libs, tmp_path):
    n = SimNode(sim_libs, tmp_path / "node")
    yield n
    n.close()
