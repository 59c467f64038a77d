#!/usr/bin/env python3
"""PyTorch-level measurements of one allocator in this process, for A/B
runs of magpie builds beside PyTorch's own allocator (bench/torch_ab.sh).

    python3 bench/torch_probe.py {pytorch|magpie} [--empty] [--server]

  --empty   host time of torch.empty + its free on the current stream, 4 KiB
            and 4 MiB, median of 7 rounds of 20,000 pairs (ns per pair)
  --server  an LLM-style server: 8 threads, each on its own stream, serve
            requests of random prompt length (64-512 tokens) and output
            length (16-128) through a 4-layer decoder of random weights
            whose key/value cache grows by one token a step (torch.cat, as
            simple servers do); after one warm-up request per thread,
            prints the generated tokens/s over 10 s and the peak of
            reserved memory in that window (torch.cuda.max_memory_reserved
            after reset_peak_memory_stats)

"magpie" installs magpie (magpie.torch.use()) from the package python3
finds (PYTHONPATH), with the library MAGPIE_LIB names. Prints one line per
measurement: "probe allocator key value".
"""
import argparse
import random
import statistics
import threading
import time

import torch


def empty_ns(nbytes, pairs=20000, rounds=7):
    n = nbytes // 4
    for _ in range(1000):
        torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            torch.empty(n, device="cuda")
        out.append((time.perf_counter_ns() - t0) / pairs)
    return statistics.median(out)


class Decoder(torch.nn.Module):
    def __init__(self, layers=4, dim=1024, heads=16, vocab=8192):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(dim, 3 * dim) for _ in range(layers)])
        self.out = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(layers)])
        self.mlp = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
             for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, cache):
        x = self.emb(tokens)  # [1, t, dim]
        b, t, d = x.shape
        h = self.heads
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.norm(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            if cache[i] is not None:
                k = torch.cat([cache[i][0], k], dim=2)
                v = torch.cat([cache[i][1], v], dim=2)
            cache[i] = (k, v)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache[i][0].shape[2] == t)
            x = x + self.out[i](a.transpose(1, 2).reshape(b, t, d))
            x = x + self.mlp[i](self.norm(x))
        return self.head(self.norm(x[:, -1]))


def server(threads=8, seconds=10.0):
    # cuDNN's attention builds an execution plan for each new key length,
    # which every decode step changes; the other backends do not.
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    model = Decoder().cuda().half().eval()
    tokens = [0] * threads
    errors = []
    window = {}

    def open_window():  # run by one thread as all pass the barrier
        torch.cuda.reset_peak_memory_stats()
        window["t0"] = time.perf_counter()
        window["stop"] = window["t0"] + seconds

    start = threading.Barrier(threads + 1, action=open_window)

    def serve(rng, stream, count):
        prompt = torch.randint(0, 8192, (1, rng.randint(64, 512)), device="cuda")
        cache = [None] * len(model.qkv)
        logits = model(prompt, cache)
        n = 0
        for _ in range(rng.randint(16, 128)):
            logits = model(logits.argmax(-1, keepdim=True), cache)
            n += 1
        stream.synchronize()
        return n if count else 0

    def worker(k):
        rng = random.Random(k)
        stream = torch.cuda.Stream()
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                serve(rng, stream, False)  # warm-up: kernels loaded, handles made
                start.wait()
                while time.perf_counter() < window["stop"]:
                    tokens[k] += serve(rng, stream, True)
        except Exception as e:  # reported, and the probe fails
            errors.append(repr(e))
            start.abort()

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    torch.cuda.synchronize()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join()
    secs = time.perf_counter() - window.get("t0", time.perf_counter())
    torch.cuda.synchronize()
    return sum(tokens) / secs, torch.cuda.max_memory_reserved(), errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("allocator", choices=("pytorch", "magpie"))
    ap.add_argument("--empty", action="store_true")
    ap.add_argument("--server", action="store_true")
    a = ap.parse_args()
    if a.allocator == "magpie":
        import magpie.torch

        magpie.torch.use()
    torch.cuda.init()
    name = a.allocator
    if a.empty:
        for nbytes in (4 << 10, 4 << 20):
            print(f"empty {name} ns_{nbytes >> 10}KiB {empty_ns(nbytes):.0f}", flush=True)
    if a.server:
        tps, peak, errors = server()
        print(f"server {name} tokens_per_s {tps:.0f}", flush=True)
        print(f"server {name} peak_reserved_MiB {peak / 2**20:.0f}", flush=True)
        if errors:
            print(f"server {name} errors {len(errors)}: {errors[0]}", flush=True)
            raise SystemExit(1)


if __name__ == "__main__":
    main()
