"""A restarted daemon: clients get a ConnectionError at once, or (reconnect=True) continue on
the new daemon, where the old objects are not found and never show up as stale memory."""

import numpy as np
import pytest

import vovp

from conftest import Daemon


def test_reconnect_to_a_restarted_daemon():
    first = Daemon(64 << 20)
    path = first.socket
    plain = vovp.init_client(path)
    resilient = vovp.init_client(path, reconnect=True)
    resilient.put_tensor("before", np.arange(1000, dtype=np.int32))
    held = resilient.get_tensor("before")
    first.proc.kill()  # not stop(): its directory (and socket path) must stay
    first.proc.wait()
    second = Daemon(64 << 20, socket_path=path)
    try:
        with pytest.raises(vovp.ConnectionError):
            plain.contains("before")
        with pytest.raises(vovp.ConnectionError):  # and stays so
            plain.contains("before")
        assert not resilient.contains("before")
        with pytest.raises(vovp.ObjectNotFound):
            resilient.get_tensor("before", timeout=0)
        resilient.put_tensor("after", np.full(300_000, 7, dtype=np.int64))  # CREATE path
        assert int(resilient.get_tensor("after")[123]) == 7
        # Arrays from before keep their own memory; dropping them releases nothing on the
        # new daemon (whose ids could name other objects).
        assert int(held[999]) == 999
        del held
        import gc
        gc.collect()
        resilient.flush()
        watcher = vovp.init_client(path)
        st = watcher.stats()
        assert st["objects"] == 1
        watcher.close()
    finally:
        plain.close()
        resilient.close()
        second.stop()
        first.stop()
