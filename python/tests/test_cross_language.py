"""Rust and Python share objects through the store: a tensor put by the Rust client (the `vovp`
CLI, a separate process) is read by Python by name alone, and the reverse."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO

CLI = Path(os.environ.get("VOVP_CLI_BIN", REPO / "target" / "debug" / "vovp"))


def cli(daemon, *args) -> str:
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing: run `cargo build --workspace --bins` first")
    out = subprocess.run([str(CLI), "-s", daemon.socket, *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int8", "uint16", "bool"])
def test_rust_put_python_get(daemon, client, dtype):
    values = [0, 1, 2, 3, 4, 5]
    cli(daemon, "put-tensor", f"r-{dtype}", "--dtype", dtype, "--shape", "2,3",
        "--values", ",".join(map(str, values)))
    got = client.get_tensor(f"r-{dtype}")
    assert got.dtype == np.dtype(dtype)
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.array(values, dtype=dtype).reshape(2, 3))


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "float64"])
def test_python_put_rust_get(daemon, client, dtype):
    a = (np.arange(12) * 3).astype(dtype).reshape(3, 4)
    client.put_tensor(f"p-{dtype}", a)
    out = json.loads(cli(daemon, "get-tensor", f"p-{dtype}"))
    assert out["dtype"] == dtype
    assert out["shape"] == [3, 4]
    np.testing.assert_array_equal(np.array(out["values"], dtype=dtype), a.ravel())


def test_zero_d_and_empty_tensors_cross(daemon, client):
    client.put_tensor("scalar", np.array(7.5, dtype=np.float64))
    out = json.loads(cli(daemon, "get-tensor", "scalar"))
    assert (out["shape"], out["values"]) == ([], [7.5])
    cli(daemon, "put-tensor", "empty", "--dtype", "int32", "--shape", "0,4")
    got = client.get_tensor("empty")
    assert got.shape == (0, 4) and got.dtype == np.int32


def test_torch_put_rust_get(daemon, client):
    """A tensor put from torch carries the framework byte after its shape (PROTOCOL.md): the
    Rust client reads the header all the same."""
    torch = pytest.importorskip("torch")
    client.put_tensor("from-torch", torch.arange(6, dtype=torch.int16).reshape(2, 3))
    out = json.loads(cli(daemon, "get-tensor", "from-torch"))
    assert (out["dtype"], out["shape"], out["values"]) == ("int16", [2, 3], list(range(6)))
