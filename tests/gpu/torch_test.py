"""magpie as PyTorch's allocator on a GPU: a small transformer-style
inference loop on several threads and streams, with tensors handed between
streams (wait_stream + record_stream), produces the same outputs under magpie
as under PyTorch's own allocator.

    GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384 \\
    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/torch_test.py

Runs each allocator in its own child process (the allocator must be chosen
before the first CUDA allocation) and compares what they computed.
"""
import os
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def child(mode, out_path):
    import torch

    if mode == "magpie":
        import magpie

        magpie.torch.use()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = torch.nn.Sequential(
        *[torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True) for _ in range(2)]
    ).to(dev).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 64 + 16 * i, 256, generator=gen) for i in range(8)]
    results = [None] * 8

    def worker(tid):
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for k in range(tid, 8, 2):
            with torch.no_grad(), torch.cuda.stream(s1):
                x = inputs[k].to(dev, non_blocking=False)
                h = layers(x)
            # Hand h to another stream: order after s1, and tell the
            # allocator h is used there.
            s2.wait_stream(s1)
            with torch.no_grad(), torch.cuda.stream(s2):
                h.record_stream(s2)
                y = layers(h * 0.5)
                results[k] = y.float().cpu()
            del h, y, x

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    torch.save(results, out_path)
    if mode == "magpie":
        import magpie

        st = magpie.stats()
        print("magpie stats:", {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "peak_in_use_bytes",
                                                  "events_recorded", "cross_stream_migrations")})
        assert st["reserved_bytes"] > 0, "no allocation went through magpie"
    print(f"{mode}: {sum(r.numel() for r in results)} output values")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    import torch

    with tempfile.TemporaryDirectory() as d:
        outs = {}
        for mode in ("native", "magpie"):
            path = os.path.join(d, mode + ".pt")
            r = subprocess.run([sys.executable, __file__, "--child", mode, path])
            if r.returncode != 0:
                print(f"{mode} run failed ({r.returncode})")
                print("0 passed, 1 failed")
                return 1
            outs[mode] = torch.load(path)
        diffs = [(a - b).abs().max().item() for a, b in zip(outs["native"], outs["magpie"])]
        same = all(torch.equal(a, b) for a, b in zip(outs["native"], outs["magpie"]))
        print(f"outputs identical: {same}; max abs difference {max(diffs):.3g}")
        ok = max(diffs) <= 1e-5
        print("1 passed, 0 failed" if ok else "0 passed, 1 failed")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
