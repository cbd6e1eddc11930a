"""Transfers between two engines from Python (the native calls vovp.cluster builds on):
``vovp.start_store(transfer=..., transfer_key=...)``, ``Client.fetch_from``,
``Client.gather_from``, ``Client.transfer_address``/``transfer_info``, explicit versions
(``PutOptions(version=...)``) and the errors of each."""

import os

import numpy as np
import pytest

import vovp
from vovp import _native as N

KEY = bytes(range(32))


@pytest.fixture
def engines():
    """Two engines serving transfers on loopback with the same key: (holder, receiver)."""
    stores = [vovp.start_store("256M", transfer="127.0.0.1:0", transfer_key=KEY)
              for _ in range(2)]
    clients = [vovp.Client(s.socket) for s in stores]
    yield clients
    for c, s in zip(clients, stores):
        c.close()
        s.stop()


def test_fetch_is_bit_exact_and_keeps_the_holders_version(engines):
    holder, receiver = engines
    address = holder.transfer_address()
    assert address is not None and address.startswith("127.0.0.1:")
    data = np.random.default_rng(1).standard_normal((1024, 256)).astype(np.float32)
    for step in range(3):
        holder.put_tensor("weights", data + step, replace=True)
    got = receiver.fetch_from(address, "weights", 3)
    assert vovp.version_of(got) == 3
    assert got.dtype == np.float32 and got.shape == (1024, 256)
    assert np.array_equal(got, data + 2)
    # Any process on the receiving side now gets it by name, at the holder's version.
    again = vovp.Client(receiver.core.path).get_tensor("weights")
    assert vovp.version_of(again) == 3 and np.array_equal(again, got)
    # A version already here: no transfer.
    fetches = receiver.transfer_info()[1]["fetches"]
    assert vovp.version_of(receiver.fetch_from(address, "weights", 2)) == 3
    assert receiver.transfer_info()[1]["fetches"] == fetches
    # A version the holder does not have: TransferFailed, nothing visible.
    with pytest.raises(vovp.TransferFailed, match="not held"):
        receiver.fetch_from(address, "weights", 7)
    assert vovp.version_of(receiver.get_tensor("weights")) == 3
    assert holder.transfer_info()[1]["refused_not_held"] == 1


def test_fetch_with_a_base_sends_only_what_changed(engines):
    holder, receiver = engines
    address = holder.transfer_address()
    v1 = np.arange(1 << 20, dtype=np.uint64)  # 8 MiB
    holder.put_tensor("state", v1, replace=True)
    receiver.fetch_from(address, "state", 1)
    v2 = v1.copy()
    v2[1000:2000] = 7
    holder.put_tensor("state", v2, replace=True)
    changed = (1000 * 8, 2000 * 8)
    unchanged = [(0, changed[0]), (changed[1], v1.nbytes - changed[1])]
    before = receiver.transfer_info()[1]["bytes_received"]
    got = receiver.fetch_from(address, "state", 2, base_version=1, base_ranges=unchanged)
    assert np.array_equal(got, v2) and vovp.version_of(got) == 2
    info = receiver.transfer_info()[1]
    assert info["bytes_received"] - before == changed[1] - changed[0]
    assert info["bytes_copied_from_base"] == v1.nbytes - (changed[1] - changed[0])


def test_gather_rows_in_the_ids_order(engines):
    holder, receiver = engines
    table = np.random.default_rng(2).standard_normal((10_000, 128)).astype(np.float32)
    holder.put_tensor("feat", table)
    ids = np.random.default_rng(3).integers(0, 10_000, 10_000).astype(np.uint64)
    ids[:3] = [5, 5, 9_999]
    rows = receiver.gather_from(holder.transfer_address(), "feat", 1, 128 * 4, ids, "rows-1")
    got = rows.view(np.float32).reshape(len(ids), 128)
    assert np.array_equal(got, table[ids])
    # A list of ints works too; a row past the end is refused.
    small = receiver.gather_from(holder.transfer_address(), "feat", 1, 512, [3, 1], "rows-2")
    assert np.array_equal(small.view(np.float32).reshape(2, 128), table[[3, 1]])
    with pytest.raises(vovp.TransferFailed, match="past"):
        receiver.gather_from(holder.transfer_address(), "feat", 1, 512, [10_000], "rows-3")


def test_explicit_versions(engines):
    c = engines[0]
    opts = N.PutOptions(replace=True, keep_reference=True, version=40)
    assert opts.version == 40 and "version=40" in repr(opts)
    # (Positional: name, src, options, metadata, layout, framework = numpy.)
    obj = c.core.native.put_with("v", np.arange(4, dtype=np.int64), opts, b"", None, 1)
    assert obj.version == 40
    with pytest.raises(vovp.StaleVersion) as e:
        c.core.native.put_with("v", np.arange(4, dtype=np.int64), opts, b"", None, 1)
    assert (e.value.current, e.value.requested) == (40, 40)
    assert vovp.version_of(c.put_tensor("v", np.zeros(2), replace=True)) == 41


def test_no_key_no_port(tmp_path):
    with vovp.start_store("64M") as plain:
        c = vovp.Client(plain.socket)
        assert c.transfer_address() is None
        assert c.transfer_info()[0] is None
        with pytest.raises(vovp.VovpError, match="transfer key"):
            c.fetch_from("127.0.0.1:9", "x", 1)
        c.close()
    with pytest.raises(ValueError):
        vovp.start_store("64M", transfer="127.0.0.1:0", transfer_key=b"short")
    # A key file of mode 0600 works as the variable does.
    key = tmp_path / "key"
    key.write_text(KEY.hex())
    os.chmod(key, 0o600)
    with vovp.start_store("64M", transfer="127.0.0.1:0", transfer_key_file=str(key)) as s:
        assert vovp.Client(s.socket).transfer_address() is not None
