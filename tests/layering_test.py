#!/usr/bin/env python3
"""The layers of src/ as the includes say (src/README.md): each module
(x.c with x.h) includes only modules of its own or lower layers, and no
include cycle joins two modules. The build already rejects an upward
include (a layer's headers are not on a lower layer's include path); this
also catches cycles inside one layer. The simulator includes only the
device interface; the preload library only the public header (and its
own files' headers).

Prints one line per violation and ends with "N passed, N failed" over the
checks."""
import os
import re
import sys

ORDER = ["base", "device", "pool", "heap", "tcache", "front", "ipc"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(path):
    with open(path) as f:
        return INCLUDE.findall(f.read())


def main(root):
    os.chdir(root)
    failures = []
    checks = 0
    modules = {}  # "layer/stem" -> set of "layer/stem" it includes
    for layer in ORDER:
        for name in sorted(os.listdir(os.path.join("src", layer))):
            if not name.endswith((".c", ".h")):
                continue
            mod = layer + "/" + name.rsplit(".", 1)[0]
            deps = modules.setdefault(mod, set())
            for inc in includes(os.path.join("src", layer, name)):
                top = inc.split("/")[0]
                checks += 1
                if top in ORDER:
                    if ORDER.index(top) > ORDER.index(layer):
                        failures.append("src/%s/%s includes %s, a higher layer" % (layer, name, inc))
                    dep = inc.rsplit(".", 1)[0]
                    if dep != mod:
                        deps.add(dep)
                elif inc not in ("magpie.h",):
                    failures.append("src/%s/%s includes %s, outside the layers" % (layer, name, inc))
    # Cycles between modules (depth-first search, grey/black marks).
    state = {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(modules.get(m, ())):
            if state.get(d) == 1:
                failures.append("include cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        checks += 1
        if m not in state:
            visit(m, [])
    for name in sorted(os.listdir("sim")):
        if name.endswith((".c", ".h")):
            for inc in includes(os.path.join("sim", name)):
                checks += 1
                if not (inc.startswith("device/") or inc.startswith("sim/") or inc in ("magpie.h", "magpie_sim.h")):
                    failures.append("sim/%s includes %s: the simulator sees only the device interface" % (name, inc))
    # The preload library's files (those in the runfiles): magpie.h and the
    # headers they share among themselves.
    preload = sorted(n for n in os.listdir("preload") if n.endswith((".c", ".h")))
    for name in preload:
        for inc in includes(os.path.join("preload", name)):
            checks += 1
            if inc != "magpie.h" and not (inc.startswith("preload/") and inc[len("preload/"):] in preload):
                failures.append("preload/%s includes %s: the preload library sees magpie.h only" % (name, inc))
    for f in failures:
        print(f)
    print("%d passed, %d failed" % (checks - len(failures), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
