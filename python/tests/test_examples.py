"""The examples in examples/ run as their users would run them, against a real daemon.

(examples/seed.py, the seed document's program, is run by test_torch.py::test_seed_program.)
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import PYTHON_DIR  # noqa: E402

EXAMPLES = PYTHON_DIR.parent / "examples"


def run_example(script, *args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR)
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_dgl_graph_example(daemon):
    """A launcher puts a CSR graph and node features once; three trainers get them by name
    alone, as torch tensors over the launcher's stored bytes, and compute what the launcher
    computes."""
    r = run_example("dgl_graph.py", daemon.socket, "--trainers", 3, "--nodes", 3000,
                    "--feat-dim", 16)
    assert r["zero_copy"] and r["torch"], r
    assert r["checksums_match"] == [True, True, True], r
    assert r["exit_codes"] == [0, 0, 0]
    c = daemon.client()
    assert c.stats()["objects"] == 0  # the launcher deleted the graph when done
    assert c.stats()["creates"] == 3  # indptr, indices, feat: put once, whatever the trainers
    c.close()
