#!/usr/bin/env python3
"""CONTRIBUTING.md's layering claims, checked on the sources.

1. One layer per folder, dependencies pointing one way:
   hook/ -> limiter/ -> shm/ -> include/platform/, and include/gpuslice/ (the
   public ABI) at the bottom beside it; limiter/, shm/ and include/platform/
   never include cuda.h. include/platform/ includes nothing of the project
   but itself (libc and the C++ headers only), and the public ABI nothing of
   the platform layer: a tool built on include/gpuslice/ needs no more.
2. Inside hook/ nothing runs back up: with hook/x.h and hook/x.cc taken as
   one unit (x), the include graph between units has no cycle.
3. hook/ reaches the driver's entry points through hook/real.h only (its
   real_ pointers, resolved at load time from symbols.def and its internal
   list): no other file looks an entry point up by name (dlsym, dlvsym,
   real_dlsym), so there is one list of driver symbols
   (docs/interception.md, "Identity substitution").

Usage: check_layers.py <source root>. Exit 0 when all hold, 1 with one line
per problem otherwise.
"""
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
# Layer (the first part of the include paths naming its headers) -> its folder.
FOLDER = {
    "hook": "hook",
    "limiter": "limiter",
    "shm": "shm",
    "platform": "include/platform",
    "gpuslice": "include/gpuslice",
}
# Layer -> the layers it may include from (besides its own).
ALLOWED = {
    "hook": {"limiter", "shm", "platform", "gpuslice"},
    "limiter": {"shm", "platform", "gpuslice"},
    "shm": {"platform", "gpuslice"},
    "platform": set(),
    "gpuslice": set(),
}
NO_DRIVER = {"limiter", "shm", "platform"}
PROJECT = {"hook", "limiter", "shm", "platform", "gpuslice", "tools", "test"}


def includes(path):
    return INCLUDE.findall(path.read_text(errors="replace"))


def layer_problems(root):
    problems = []
    for layer, allowed in ALLOWED.items():
        folder = FOLDER[layer]
        if not (root / folder).is_dir():
            problems.append(f"{folder}/: the {layer} layer's folder is missing")
            continue
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".h", ".cc", ".def"):
                continue
            for inc in includes(path):
                top = inc.split("/", 1)[0]
                if "/" in inc and top in PROJECT and top != layer and top not in allowed:
                    problems.append(f"{path.relative_to(root)}: includes {inc}, against {folder}/'s layer")
                if layer in NO_DRIVER and inc == "cuda.h":
                    problems.append(f"{path.relative_to(root)}: includes cuda.h ({folder}/ speaks no driver)")
    # Nothing else lives in include/: a folder there is a layer of FOLDER.
    for path in sorted((root / "include").iterdir()):
        rel = str(path.relative_to(root))
        if path.is_dir() and rel not in FOLDER.values():
            problems.append(f"{rel}/: a folder of include/ that is no known layer")
    return problems


def hook_cycles(root):
    hook = root / "hook"
    graph = {}
    for path in sorted(hook.glob("*")):
        if path.suffix not in (".h", ".cc"):
            continue
        unit = path.stem
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


# The driver layer (real.cc, real.h) and the exported dlsym (dlsym.cc) are
# the files that may look a name up.
LOOKUP = re.compile(r"\b(?:real_dlsym|dlsym|dlvsym)\s*\(")
LOOKUP_FILES = {"real.cc", "real.h", "dlsym.cc"}


def by_name_lookups(root):
    problems = []
    for path in sorted((root / "hook").glob("*")):
        if path.suffix not in (".h", ".cc") or path.name in LOOKUP_FILES:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("//", 1)[0]
            if LOOKUP.search(code):
                problems.append(f"{path.relative_to(root)}:{n}: looks a driver entry point up by name; "
                                "use hook/real.h's real_ pointer (add the symbol to its internal list)")
    return problems


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = layer_problems(root) + hook_cycles(root) + by_name_lookups(root)
    for p in problems:
        print(p)
    print(f"layers, hook/ include graph and driver lookups checked; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
