#!/usr/bin/env python3
"""Memory history of a short training loop under one allocator: PyTorch's
snapshot pickle and torch.cuda._memory_viz's trace and segment pages, the
input of tools/memory_viz_png.py.

    python3 bench/torch_trace.py {pytorch|magpie} OUT_DIR

Six steps of a 4-layer MLP (batch 256, width 2048, AdamW) with
_record_memory_history(context "all", stacks "python"); writes
OUT_DIR/ALLOCATOR_trace.pickle, ALLOCATOR_trace.html and
ALLOCATOR_segments.html, and prints the trace's event counts.
"""
import collections
import os
import pickle
import sys

import torch


def main():
    name, out = sys.argv[1], sys.argv[2]
    if name == "magpie":
        import magpie.torch

        magpie.torch.use()
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    for _ in range(6):
        x = torch.randn(256, 2048, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    path = os.path.join(out, f"{name}_trace.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    from torch.cuda import _memory_viz

    for kind, fn in (("trace", _memory_viz.trace_plot), ("segments", _memory_viz.segment_plot)):
        with open(os.path.join(out, f"{name}_{kind}.html"), "w") as f:
            f.write(fn(snap))
    actions = collections.Counter(e["action"] for t in snap["device_traces"] for e in t)
    print(f"{name}: {len(snap['segments'])} segments, trace {dict(actions)}, peak reserved "
          f"{torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
