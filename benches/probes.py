#!/usr/bin/env python3
"""Reliability probes that Plasma can run too: the same code against both stores.

Run by the Rust harness (benches/src/probes.rs) once per probe and store, each time on a fresh
daemon, which the harness starts and watches (it tells whether the daemon survived). The store's
Python client is pyarrow 11's ``pyarrow.plasma`` for Plasma and ``vovp.plasma`` (the same API)
for vovp, so each probe is one piece of code; only the module differs. Raw-socket probes speak
each store's own framing.

Every call that could hang runs in a thread with a time limit: a hang is a result ("no answer in
N s"), never a stuck run. Prints one JSON object on stdout:
  {"probe", "store", "ok" (the property held), "outcome" (one line), ...figures}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

MiB = 1 << 20


def load(store):
    if store == "plasma":
        import pyarrow.plasma as plasma
    else:
        import vovp.plasma as plasma
    return plasma


def oid(plasma, name):
    return plasma.ObjectID(hashlib.sha1(name.encode()).digest())


class Timeout(Exception):
    pass


def bounded(fn, seconds):
    """fn() in a thread; its result, its exception re-raised, or Timeout after `seconds`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Timeout(f"no answer in {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def describe(e):
    return f"{type(e).__name__}: {e}".strip()


def served(plasma, sock, tag, seconds=5.0):
    """A fresh client can connect, put, get back the bytes and delete: the store serves."""

    def go():
        c = plasma.connect(sock, num_retries=1)
        o = oid(plasma, f"served-{tag}-{time.monotonic_ns()}")
        data = bytes(range(256)) * 4
        c.put_raw_buffer(data, object_id=o)
        [b] = c.get_buffers([o], timeout_ms=1000)
        ok = b is not None and bytes(memoryview(b)) == data
        del b
        c.delete([o])
        c.disconnect()
        return ok

    try:
        return bool(bounded(go, seconds)), ""
    except Exception as e:  # noqa: BLE001
        return False, describe(e)


def spawn_child(args, role, extra):
    """This script as a client process that prints one line when it is where it should be."""
    cmd = [sys.executable, os.path.abspath(__file__), "--store", args.store, "--socket",
           args.socket, "--capacity", str(args.capacity), "--child", role] + extra
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    line = bounded(p.stdout.readline, 20).strip()
    return p, line


def kill(p):
    p.send_signal(signal.SIGKILL)
    p.wait()


def wait_for(cond, seconds):
    """Polls cond() (True, or an exception meaning not yet) every 10 ms; seconds taken or None."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < seconds:
        try:
            if cond():
                return time.monotonic() - t0, ""
        except Exception as e:  # noqa: BLE001 - "not yet"
            last = describe(e)
        time.sleep(0.01)
    return None, last


# --- child roles --------------------------------------------------------------------------------


def child(args):
    plasma = load(args.store)
    c = plasma.connect(args.socket)
    if args.child == "create":
        # Create 60 % of the store, write half of it, never seal.
        size = int(args.capacity * 0.6)
        buf = c.create(oid(plasma, "victim"), size)
        np.frombuffer(buf, np.uint8)[: size // 2] = 0xAB
        print("created", flush=True)
    elif args.child == "hold":
        [b] = c.get_buffers([oid(plasma, "held")], timeout_ms=5000)
        assert b is not None
        print("holding", flush=True)
    elif args.child == "get":
        print("getting", flush=True)
        c.get_buffers([oid(plasma, "never-yet")])  # waits forever
    time.sleep(120)


# --- probes -------------------------------------------------------------------------------------


def probe_kill_mid_create(args, plasma):
    """A client SIGKILLed between CREATE and SEAL (60 % of the store written halfway): is the
    object gone, and its memory and its id free again?"""
    c = plasma.connect(args.socket)
    p, line = spawn_child(args, "create", [])
    assert line == "created", line
    kill(p)
    size = int(args.capacity * 0.6)

    def reuse():
        # The buffer lives until after the seal (Plasma seals only objects still in use).
        b = c.create(oid(plasma, "after"), size)
        c.seal(oid(plasma, "after"))
        del b
        c.delete([oid(plasma, "after")])
        return True

    secs, last = wait_for(reuse, 10)
    gone = not c.contains(oid(plasma, "victim"))
    same_id = False
    try:
        c.create_and_seal(oid(plasma, "victim"), b"x")
        same_id = True
    except Exception as e:  # noqa: BLE001
        last = last or describe(e)
    ok = secs is not None and gone and same_id
    outcome = (f"memory reusable after {secs * 1000:.0f} ms, id free again" if ok
               else f"not recovered within 10 s (object gone: {gone}, id free: {same_id}; {last})")
    return dict(ok=ok, outcome=outcome, recovery_ms=None if secs is None else secs * 1000)


def probe_kill_holding(args, plasma):
    """A client SIGKILLed while it holds a got object (60 % of the store): does its reference
    die with it, so the memory can be evicted for a new object?"""
    c = plasma.connect(args.socket)
    size = int(args.capacity * 0.6)
    c.create_and_seal(oid(plasma, "held"), b"h" * size)
    p, line = spawn_child(args, "hold", [])
    assert line == "holding", line
    # While the holder lives the object must stay: a create that needs its memory fails.
    try:
        bounded(lambda: c.create(oid(plasma, "too-soon"), size), 5)
        evicted_while_held = True
    except Exception:  # noqa: BLE001 - expected: store full
        evicted_while_held = False
    kill(p)

    def reuse():
        b = c.create(oid(plasma, "after"), size)
        c.seal(oid(plasma, "after"))
        del b
        return True

    secs, last = wait_for(reuse, 10)
    ok = secs is not None and not evicted_while_held
    outcome = (f"memory reusable after {secs * 1000:.0f} ms (the dead holder's reference dropped)"
               if ok else f"not recovered within 10 s ({last}; held object evicted while held: "
               f"{evicted_while_held})")
    return dict(ok=ok, outcome=outcome, recovery_ms=None if secs is None else secs * 1000)


def probe_kill_in_get(args, plasma):
    """Plasma's test_client_death_during_get: a client blocked in a GET for a missing object is
    SIGKILLed; the object is then created and the store still answers."""
    c = plasma.connect(args.socket)
    p, line = spawn_child(args, "get", [])
    assert line == "getting", line
    time.sleep(0.2)
    kill(p)
    time.sleep(0.1)
    try:
        bounded(lambda: c.put(1, object_id=oid(plasma, "never-yet")), 5)
        bounded(lambda: c.contains(oid(plasma, "other")), 5)
        alive, why = served(plasma, args.socket, "get")
    except Exception as e:  # noqa: BLE001
        alive, why = False, describe(e)
    return dict(ok=alive, outcome="the store serves on" if alive else f"store broken: {why}")


def probe_store_full(args, plasma):
    """Plasma's test_store_full: the store full of objects that are all held; one more create
    must fail at once with 'store full' (not hang), and succeed once they are released."""
    c = plasma.connect(args.socket)
    part = args.capacity // 10
    held, n = [], 0
    err, secs = None, None
    for i in range(20):
        o = oid(plasma, f"full-{i}")
        t0 = time.monotonic()
        try:
            b = bounded(lambda o=o: c.create(o, part), 10)
        except Exception as e:  # noqa: BLE001
            err, secs = e, time.monotonic() - t0
            break
        np.frombuffer(b, np.uint8)[:8] = 0xFF
        c.seal(o)
        [g] = c.get_buffers([o])
        del b
        held.append(g)
        n += 1
    hung = isinstance(err, Timeout)
    full_error = err is not None and not hung and "Full" in type(err).__name__
    held.clear()
    recovered, last = wait_for(lambda: c.create(oid(plasma, "after-full"), 5 * part) is not None,
                               10)
    ok = full_error and secs is not None and secs < 1 and recovered is not None
    outcome = (f"{n} objects of {part // MiB} MiB fit; the next create: "
               + ("no answer within 10 s" if hung else
                  f"{type(err).__name__} in {secs * 1000:.1f} ms" if err else "never failed")
               + ("; after release a create of half the store succeeds" if recovered is not None
                  else f"; after release still full ({last})"))
    return dict(ok=ok, outcome=outcome, fitted=n,
                error=None if err is None else describe(err),
                error_ms=None if secs is None else secs * 1000)


def probe_connection_flood(args, plasma):
    """Connection flood: args.flood clients connect and stay (the daemon runs with
    `ulimit -n 1024`); a client connected before keeps being served, a new one gets either
    in or an error at once (not a hang), and once the flood leaves new clients get in again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    old = plasma.connect(args.socket)
    o = oid(plasma, "old")
    old.put_raw_buffer(b"o" * 4096, object_id=o)
    flood, first_fail, t0 = [], None, time.monotonic()
    fail_kind = None
    for i in range(args.flood):
        try:
            flood.append(bounded(lambda: plasma.connect(args.socket, num_retries=1), 5))
        except Exception as e:  # noqa: BLE001
            first_fail = i
            fail_kind = "hang" if isinstance(e, Timeout) else describe(e)
            break
    flood_secs = time.monotonic() - t0

    def old_get():
        [b] = old.get_buffers([o], timeout_ms=1000)
        return b is not None and bytes(memoryview(b)) == b"o" * 4096

    try:
        old_ok = bool(bounded(old_get, 5))
    except Exception as e:  # noqa: BLE001
        old_ok, old_why = False, describe(e)
    else:
        old_why = ""
    for c in flood:
        try:
            bounded(c.disconnect, 5)
        except Exception:  # noqa: BLE001
            pass
    flood.clear()
    after, last = wait_for(lambda: served(plasma, args.socket, "after", 2)[0], 10)
    got = args.flood if first_fail is None else first_fail
    # Past its limit a store may refuse, but at once: a client left hanging is the failure.
    refused_at_once = first_fail is None or (fail_kind != "hang")
    ok = old_ok and after is not None and refused_at_once
    outcome = (f"{got} of {args.flood} clients connected in {flood_secs:.1f} s"
               + ("" if first_fail is None else f", the next one: {fail_kind}")
               + f"; the client connected before: {'served' if old_ok else 'NOT served ' + old_why}"
               + ("; after the flood new clients get in"
                  + (f" ({after * 1000:.0f} ms)" if after > 0.05 else "")
                  if after is not None else f"; after the flood: still refused ({last})"))
    return dict(ok=ok, outcome=outcome, connected=got, first_failure=fail_kind,
                old_client_served=old_ok, recovered=after is not None)


def raw_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def read_some(s, seconds=2.0):
    """What the store sends back within `seconds`: bytes, and whether it closed."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got, True
            got += chunk
    except (socket.timeout, TimeoutError):
        return got, False
    except OSError:
        return got, True


# The frame header's version byte of vovp's wire protocol (PROTOCOL.md).
VOVP_WIRE_VERSION = 2


def bad_frame(args, frame, name):
    plasma = load(args.store)
    before, why0 = served(plasma, args.socket, "before")
    s = raw_connect(args.socket)
    if args.store == "vovp":
        # HELLO first, so the bad frame is judged as a request, not as a missing handshake.
        s.sendall(struct.pack("<IBBHQI", 16, VOVP_WIRE_VERSION, 1, 0, 1, os.getpid()))
        read_some(s, 0.5)
    s.sendall(frame)
    reply, closed = read_some(s)
    s.close()
    time.sleep(0.2)
    after, why = served(plasma, args.socket, "after")
    answer = (f"{len(reply)} bytes of reply" if reply else "no reply") + (
        ", connection closed" if closed else ", connection kept")
    ok = before and after
    return dict(ok=ok, outcome=f"{name}: {answer}; "
                + ("the store serves on" if after else f"the store no longer serves ({why})"),
                reply_bytes=len(reply), closed=closed)


def probe_unknown_message(args, plasma):
    """One frame of a message type the store does not know (its own framing otherwise)."""
    if args.store == "vovp":
        frame = struct.pack("<IBBHQ", 12, VOVP_WIRE_VERSION, 0x55, 0, 2)
    else:
        # Plasma: int64 protocol version (0), int64 message type, int64 payload length.
        frame = struct.pack("<qqq", 0, 9999, 0)
    return bad_frame(args, frame, "unknown message type")


def probe_garbage(args, plasma):
    """1 KiB of random bytes sent to the socket (after vovp's HELLO)."""
    return bad_frame(args, random.Random(1).randbytes(1024), "1 KiB of random bytes")


def probe_bad_length(args, plasma):
    """A frame header that claims a payload of about 2^62 bytes."""
    if args.store == "vovp":
        frame = struct.pack("<IBBHQ", 0xFFFFFFF0, VOVP_WIRE_VERSION, 0x05, 0, 3)
    else:
        frame = struct.pack("<qqq", 0, 1, 1 << 62)
    return bad_frame(args, frame, "absurd frame length")


PROBES = {
    "kill_mid_create": probe_kill_mid_create,
    "kill_holding": probe_kill_holding,
    "kill_in_get": probe_kill_in_get,
    "store_full": probe_store_full,
    "connection_flood": probe_connection_flood,
    "unknown_message": probe_unknown_message,
    "garbage": probe_garbage,
    "bad_length": probe_bad_length,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", choices=["vovp", "plasma"], required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--capacity", type=int, required=True)
    ap.add_argument("--probe", choices=sorted(PROBES))
    ap.add_argument("--flood", type=int, default=1500)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    plasma = load(args.store)
    t0 = time.monotonic()
    try:
        r = PROBES[args.probe](args, plasma)
    except Exception as e:  # noqa: BLE001 - a probe that could not run says why
        r = dict(ok=False, outcome=f"probe failed: {describe(e)}")
    r.update(probe=args.probe, store=args.store, seconds=time.monotonic() - t0)
    print(json.dumps(r), flush=True)
    # Threads stuck in a hung store call must not keep the process alive.
    os._exit(0)


if __name__ == "__main__":
    main()
