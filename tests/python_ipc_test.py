"""magpie.ipc between processes on the simulated device (run by
python_ipc_test.sh, which sets MAGPIE_LIB, MAGPIE_BACKEND=sim and
PYTHONPATH). The simulated device's memory is host memory shared through
memfds, so both processes read and write blocks with ctypes.

The parent allocates blocks through magpie (4 KiB: magpie_malloc; 8 MiB:
magpie_malloc_async on stream 0), stamps them, exports them and starts
children (this file with --child ROLE) that import them:
  roundtrip   the child finds the parent's pattern, writes its own, closes
              (again: nothing; a with-block; garbage collection); the parent
              reads the child's pattern
  held        hold=True exports freed by the parent before the child imports
              them: not reused meanwhile, intact for the child; after the
              child's close the large block is reused
  failures    an import after the parent freed a non-held block, after a
              revoke, of a garbage handle, a revoke by another process, and
              of a handle whose exporter exited (whose earlier import stays
              readable): each fails with magpie's error and reason
  peer        two simulated devices: can_access_peer / enable_peer_access /
              disable_peer_access
Prints one line per check; exits nonzero at the first failure.
"""
import ctypes
import gc
import os
import subprocess
import sys
import time

import magpie
from magpie import _lib, ipc

SMALL, LARGE = 4096, 8 << 20
MAGPIE_ERR_INVALID_POINTER, MAGPIE_ERR_INVALID_ARGUMENT, MAGPIE_ERR_IPC = 1, 7, 13

l = _lib.lib()
l.magpie_malloc.argtypes = [ctypes.c_size_t]
l.magpie_malloc.restype = ctypes.c_void_p
l.magpie_free.argtypes = [ctypes.c_void_p]
l.magpie_free.restype = ctypes.c_int


def pattern(seed, n):
    """n bytes repeating with period 251 (a prime: a block read at a shifted
    address does not match), different per seed."""
    unit = bytes((i * 7 + seed * 13) % 251 for i in range(251))
    return (unit * (n // 251 + 1))[:n]


def stamp(ptr, seed, n):
    ctypes.memmove(ptr, pattern(seed, n), n)


def holds(ptr, seed, n):
    return ctypes.string_at(ptr, n) == pattern(seed, n)


def alloc(size):
    p = l.magpie_malloc(size) if size <= SMALL else l.magpie_malloc_async(size, None)
    assert p, l.magpie_last_error_message().decode()
    return p


def free(p):
    assert l.magpie_free(p) == 0, l.magpie_last_error_message().decode()


def expect_error(fn, code, *words):
    """fn() must raise MagpieError with code and each of words in its text;
    returns the text."""
    try:
        fn()
    except magpie.MagpieError as e:
        text = str(e)
        assert e.code == code, f"code {e.code}, expected {code}: {text}"
        for w in words:
            assert w in text, f"{w!r} not in {text!r}"
        return text
    raise AssertionError(f"no error (expected magpie error {code}: {words})")


# ---- children ----


def child_roundtrip(items):
    """items: HEX:SIZE:SEED. Import, check, answer with seed + 100, close;
    the first through close() twice, the second in a with-block, the rest
    by garbage collection."""
    for k, item in enumerate(items):
        hexh, size, seed = item.split(":")
        size, seed = int(size), int(seed)
        imp = ipc.open(bytes.fromhex(hexh))
        assert imp.size == size, (imp.size, size)
        assert not imp.closed and f"size={size}" in repr(imp), repr(imp)
        assert holds(imp.ptr, seed, size), f"block {k}: the parent's pattern is not there"
        stamp(imp.ptr, seed + 100, size)
        ptr = imp.ptr
        if k == 0:
            imp.close()
            imp.close()  # again: nothing
            assert imp.closed
        elif k == 1:
            with imp as same:
                assert same is imp
            assert imp.closed
        else:
            del imp
            gc.collect()
        # Closed: magpie no longer knows the address.
        rc = l.magpie_ipc_close(ctypes.c_void_p(ptr), None)
        assert rc == MAGPIE_ERR_INVALID_POINTER, f"block {k}: the import is still open after its close ({rc})"
    print("child: imported, checked, answered and closed", len(items), "blocks")


def child_held(items):
    """Import each, check, answer; report, wait for the parent's word, close."""
    imps = []
    for item in items:
        hexh, size, seed = item.split(":")
        imp = ipc.open(bytes.fromhex(hexh))
        assert imp.size == int(size), (imp.size, size)
        assert holds(imp.ptr, int(seed), int(size)), "a held block lost its contents before the import"
        stamp(imp.ptr, int(seed) + 100, int(size))
        imps.append(imp)
    print("imported", flush=True)
    sys.stdin.readline()
    for imp in imps:
        imp.close(0)
    print("closed", flush=True)


def child_fails(items):
    """items: HEX:CODE:WORDS (words separated by '+')."""
    for item in items:
        hexh, code, words = item.split(":")
        text = expect_error(lambda: ipc.open(bytes.fromhex(hexh)), int(code), *words.split("+"))
        print("child: refused as expected:", text)


def child_garbage(items):
    good = bytes.fromhex(items[0])
    expect_error(lambda: ipc.revoke(good), MAGPIE_ERR_INVALID_ARGUMENT, "only that process can revoke")
    expect_error(lambda: ipc.open(bytes(ipc.HANDLE_SIZE)), MAGPIE_ERR_INVALID_ARGUMENT, "not a magpie IPC handle")
    expect_error(lambda: ipc.open(os.urandom(ipc.HANDLE_SIZE)), MAGPIE_ERR_INVALID_ARGUMENT, "not a magpie IPC handle")
    try:
        ipc.open(good[:64])
        raise AssertionError("a 64-byte handle was accepted")
    except ValueError as e:
        assert "128" in str(e), str(e)
    print("child: garbage handles refused")


def child_exporter(_):
    """Export a stamped block, print its handle, exit at the parent's word."""
    p = alloc(SMALL)
    stamp(p, 9, SMALL)
    print(ipc.export(p).hex(), flush=True)
    sys.stdin.readline()


def child_peer(_):
    assert magpie.can_access_peer(0, 1) is True
    assert magpie.can_access_peer(1, 0) is True
    magpie.enable_peer_access(0, 1)
    magpie.enable_peer_access(0, 1)  # again: nothing changes, nothing refused
    magpie.enable_peer_access(1, 0)
    expect_error(lambda: magpie.enable_peer_access(0, 0), MAGPIE_ERR_INVALID_ARGUMENT, "its own memory")
    expect_error(lambda: magpie.can_access_peer(1, 1), MAGPIE_ERR_INVALID_ARGUMENT)
    expect_error(lambda: magpie.enable_peer_access(0, 2), MAGPIE_ERR_INVALID_ARGUMENT)
    # Memory mapped after the grant is covered too: an allocation works.
    free(alloc(LARGE))
    magpie.disable_peer_access(0, 1)
    magpie.disable_peer_access(0, 1)  # again: nothing to take back
    expect_error(lambda: magpie.disable_peer_access(0, 0), MAGPIE_ERR_INVALID_ARGUMENT, "its own memory")
    free(alloc(LARGE))
    print("child: peer access on two simulated devices")


CHILDREN = {
    "roundtrip": child_roundtrip,
    "held": child_held,
    "fails": child_fails,
    "garbage": child_garbage,
    "exporter": child_exporter,
    "peer": child_peer,
}


# ---- parent ----


def spawn(role, items=(), env=None, interactive=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", role, *items]
    e = dict(os.environ, **(env or {}))
    if interactive:
        return subprocess.Popen(cmd, env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=120)
    sys.stdout.write(r.stdout)
    assert r.returncode == 0, f"child {role} failed ({r.returncode}):\n{r.stderr}"
    return r


def item(handle, size, seed):
    return f"{handle.hex()}:{size}:{seed}"


def check(name):
    print("ok  ", name, flush=True)
    sys.stderr.flush()


def test_roundtrip():
    blocks = [(alloc(s), s, seed) for seed, s in enumerate([SMALL, LARGE, SMALL, LARGE], start=1)]
    items = []
    for p, s, seed in blocks:
        stamp(p, seed, s)
        h = ipc.export(p)
        assert len(h) == ipc.HANDLE_SIZE and isinstance(h, bytes)
        assert ipc.export(p) == h, "exporting a block again gave another handle"
        items.append(item(h, s, seed))
    spawn("roundtrip", items)
    for p, s, seed in blocks:
        assert holds(p, seed + 100, s), f"the child's writes to the {s}-byte block are not seen"
        free(p)
    check("round trip: 4 KiB and 8 MiB blocks, both ways, closed by close(), with and garbage collection")


def comes_back(p, s):
    """Whether the freed block at p (s bytes) is handed out again within a
    second. A block that was exported waits, parked, until an allocation's
    slow path finds it free of holds, and an importer's close reaches this
    process's server asynchronously: hence the retries. The blocks taken
    meanwhile stay allocated, so that each try is a new block."""
    taken = []
    for _ in range(20):
        taken.append(alloc(s))
        if taken[-1] == p:
            break
        time.sleep(0.05)
    for q in taken:
        free(q)
    return p in taken


def test_held():
    # Control: a freed block comes back to the next allocation of its size.
    for s in (SMALL, LARGE):
        p = alloc(s)
        free(p)
        q = alloc(s)
        assert q == p, f"control: a freed {s}-byte block was not reused at once"
        free(q)
    blocks = [(alloc(s), s, seed) for seed, s in ((21, SMALL), (22, LARGE))]
    items = []
    for p, s, seed in blocks:
        stamp(p, seed, s)
        items.append(item(ipc.export(p, hold=True), s, seed))
        free(p)  # before any import
    for p, s, seed in blocks:
        others = [alloc(s) for _ in range(4)]
        for q in others:
            stamp(q, 0, s)
        assert p not in others, f"a held {s}-byte block was handed out again before its import"
        for q in others:
            free(q)
    c = spawn("held", items, interactive=True)
    try:
        line = c.stdout.readline().strip()
        assert line == "imported", f"child: {line!r}"
        for p, s, seed in blocks:
            assert holds(p, seed + 100, s), "the child's writes to a held block are not seen"
        c.stdin.write("\n")
        c.stdin.flush()
        assert c.stdout.readline().strip() == "closed"
    finally:
        c.stdin.close()
        assert c.wait(timeout=60) == 0
    check("held exports: freed before the import, not reused, intact for the child")
    # Closed everywhere: the large block goes back to the pools.
    assert comes_back(blocks[1][0], LARGE), "the held 8 MiB block never came back after its importer closed it"
    check("held export: the 8 MiB block is reused once its importer closed it")


def test_failures():
    items = []
    # Freed before the import, without a hold.
    for s in (SMALL, LARGE):
        p = alloc(s)
        h = ipc.export(p)
        free(p)
        # The exporter's answer says "freed" either way: "freed the block
        # before this import" while it still tracks the export, "freed and
        # reused" once the block went back to the pools.
        items.append(f"{h.hex()}:{MAGPIE_ERR_IPC}:refused+freed")
    # Revoked while allocated (a held export: the revoke also drops the
    # hold, so the block is reused once freed).
    p = alloc(LARGE)
    h = ipc.export(p, hold=True)
    ipc.revoke(h)
    items.append(f"{h.hex()}:{MAGPIE_ERR_IPC}:revoked the handle")
    spawn("fails", items)
    free(p)
    assert comes_back(p, LARGE), "a revoked hold still kept the block out of reuse"
    check("an import after a free without hold, and after a revoke, fails with the reason")
    p = alloc(SMALL)
    good = ipc.export(p)
    spawn("garbage", [good.hex()])
    free(p)
    expect_error(lambda: ipc.revoke(bytes(ipc.HANDLE_SIZE)), MAGPIE_ERR_INVALID_ARGUMENT, "not a magpie IPC handle")
    check("garbage handles and another process's revoke fail cleanly")
    # The exporter exits: an import made before stays readable until closed;
    # a new import fails.
    e = spawn("exporter", interactive=True)
    try:
        h = bytes.fromhex(e.stdout.readline().strip())
        imp = ipc.open(h)
        assert imp.size == SMALL and holds(imp.ptr, 9, SMALL)
        e.stdin.write("\n")
        e.stdin.flush()
    finally:
        e.stdin.close()
        assert e.wait(timeout=60) == 0
    assert holds(imp.ptr, 9, SMALL), "an import lost its memory when its exporter exited"
    imp.close()
    text = expect_error(lambda: ipc.open(h), MAGPIE_ERR_IPC, "the exporting process", "is gone")
    print("     ", text)
    check("an exporter that exited: its import stays valid; importing its handle fails")


def test_peer():
    expect_error(lambda: magpie.enable_peer_access(0, 1), MAGPIE_ERR_INVALID_ARGUMENT)
    spawn("peer", env={"MAGPIE_SIM_DEVICES": "2"})
    check("peer access: one device refuses device 1; two devices grant each other")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        CHILDREN[sys.argv[2]](sys.argv[3:])
        return 0
    assert l.magpie_active_backend() == 2, "not on the simulated device (MAGPIE_BACKEND_SIM)"
    test_roundtrip()
    test_held()
    test_failures()
    test_peer()
    st = magpie.stats()
    assert st["in_use_bytes"] == 0, st["in_use_bytes"]
    print("python ipc: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
