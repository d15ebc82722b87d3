#!/usr/bin/env python3
"""CONTRIBUTING.md's layering claims, checked on the sources.

1. One layer per top-level folder, dependencies pointing one way:
   hook/ -> limiter/ -> shm/ -> include/; limiter/ and shm/ never include cuda.h.
2. Inside hook/ nothing runs back up: with each header and the .cc files that
   implement it taken as one unit, the include graph between units has no
   cycle (docs/interception.md, "Bootstrap", names the runtime's files).

Usage: check_layers.py <source root>. Exit 0 when both hold, 1 with one line
per problem otherwise.
"""
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
# Layer -> the project folders it may include from (besides its own).
ALLOWED = {
    "hook": {"limiter", "shm", "gpuslice"},
    "limiter": {"shm", "gpuslice"},
    "shm": {"gpuslice"},
    "include": {"gpuslice"},
}
PROJECT = {"hook", "limiter", "shm", "gpuslice", "tools", "test"}
# .cc files that implement a header of another name.
IMPLEMENTS = {"bootstrap": "runtime", "lifecycle": "runtime", "region": "runtime"}


def includes(path):
    return INCLUDE.findall(path.read_text(errors="replace"))


def layer_problems(root):
    problems = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((root / layer).rglob("*")):
            if path.suffix not in (".h", ".cc"):
                continue
            for inc in includes(path):
                top = inc.split("/", 1)[0]
                if "/" in inc and top in PROJECT and top != layer and top not in allowed:
                    problems.append(f"{path.relative_to(root)}: includes {inc}, against {layer}/'s layer")
                if layer in ("limiter", "shm") and inc == "cuda.h":
                    problems.append(f"{path.relative_to(root)}: includes cuda.h ({layer}/ speaks no driver)")
    return problems


def unit_of(path, headers):
    stem = path.stem
    if path.suffix == ".h":
        return stem
    if stem in IMPLEMENTS:
        return IMPLEMENTS[stem]
    if stem in headers:
        return stem
    prefix = stem.split("_", 1)[0]  # launch_queue.cc implements launch.h
    return prefix if prefix in headers else path.name


def hook_cycles(root):
    hook = root / "hook"
    headers = {p.stem for p in hook.glob("*.h")}
    graph = {}
    for path in sorted(hook.glob("*")):
        if path.suffix not in (".h", ".cc"):
            continue
        unit = unit_of(path, headers)
        edges = graph.setdefault(unit, set())
        for inc in includes(path):
            if inc.startswith("hook/") and inc.endswith(".h"):
                target = pathlib.PurePath(inc).stem
                if target != unit:
                    edges.add(target)
    cycles = []
    state = {}
    stack = []

    def visit(unit):
        state[unit] = 1
        stack.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit)
    return [f"hook/: include cycle {c}" for c in cycles]


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = layer_problems(root) + hook_cycles(root)
    for p in problems:
        print(p)
    print(f"layers and hook/ include graph checked; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
