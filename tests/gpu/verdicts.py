"""PASS/FAIL lines and their counts, shared by the GPU tests' Python
scripts (torch_ipc_test.py, torch_multi_gpu_test.py): each check prints
one line as it is decided, and the script ends with the counts."""


class Results:
    def __init__(self):
        self.passed = self.failed = 0

    def verdict(self, name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1
