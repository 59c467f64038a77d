"""torch.compile(mode="reduce-overhead") with its default CUDA graph trees,
under PyTorch's allocator and under magpie.torch.use(), each in a process
of its own, on a GPU.

    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/torch_compile_test.py

Each child compiles a small transformer block with mode="reduce-overhead"
(cudagraph trees: PyTorch records a graph per input shape into one private
pool, checkpoints the allocator's state of that pool and restores it
between recordings), runs it at batch sizes 1, 4, 16 and 64 (four
distinct graphs) three times each, then ten compiled training steps
(forward and backward through the compiled model, SGD eagerly). It
prints a checksum of every output, the loss of every step and
torch.cuda.max_memory_reserved().

Verdicts: both children ran; the outputs and losses are equal (to 1e-5
relative: the same kernels run under both); magpie's peak reserved is no
higher than PyTorch's allocator's. "N passed, N failed".
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(mode):
    for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
        if os.path.isdir(os.path.join(p, "magpie")):
            sys.path.insert(0, p)
            break
    if mode == "magpie":
        import magpie.torch

        magpie.torch.use()
    import torch

    torch.manual_seed(0)
    dim = 256

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(dim)
            self.attn = torch.nn.MultiheadAttention(dim, 4, batch_first=True)
            self.norm2 = torch.nn.LayerNorm(dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    model = Block().cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    sums = []
    with torch.no_grad():
        for batch in (1, 4, 16, 64):
            g = torch.Generator(device="cuda").manual_seed(batch)
            x = torch.randn(batch, 32, dim, device="cuda", generator=g)
            for _ in range(3):
                y = compiled(x)
                sums.append(float(y.double().sum()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    g = torch.Generator(device="cuda").manual_seed(1234)
    for _ in range(10):
        x = torch.randn(8, 32, dim, device="cuda", generator=g)
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    torch.cuda.synchronize()
    out = {"mode": mode, "sums": sums, "losses": losses,
           "peak_reserved": torch.cuda.max_memory_reserved()}
    if mode == "magpie":
        out["kind"] = magpie.torch.kind()
    print("RESULT " + json.dumps(out), flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    results, verdicts = {}, []
    for mode in ("pytorch", "magpie"):
        r = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True, timeout=900)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            print(f"--- {mode} (exit {r.returncode})\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
            verdicts.append((f"{mode}: ran", False))
            continue
        results[mode] = json.loads(line[0][7:])
        verdicts.append((f"{mode}: ran", True))
        m = results[mode]
        print(f"{mode}: peak reserved {m['peak_reserved']} B, losses {m['losses'][:3]}...")
    if len(results) == 2:
        a, b = results["pytorch"], results["magpie"]

        def close(x, y):
            return all(abs(p - q) <= 1e-5 * max(1.0, abs(p)) for p, q in zip(x, y)) and len(x) == len(y)

        verdicts.append(("outputs equal (4 batch sizes x 3 calls)", close(a["sums"], b["sums"])))
        verdicts.append(("training losses equal (10 steps)", close(a["losses"], b["losses"])))
        verdicts.append((f"peak reserved: magpie {b['peak_reserved']} <= PyTorch {a['peak_reserved']}",
                         b["peak_reserved"] <= a["peak_reserved"]))
    for name, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    passed = sum(1 for _, ok in verdicts if ok)
    print(f"{passed} passed, {len(verdicts) - passed} failed")
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
