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
3. Inside hook/ a .cc implements only the header of its own stem: every
   function and variable a hook/ header declares out of line (at namespace
   scope, not inline) is defined in the .cc of the same name, and nowhere
   else. A header of inline code only has no .cc; a .cc without a header
   defines the exported entry points and file-local code only. So a file's
   name says where a declaration lives.
4. hook/ reaches the driver's entry points through hook/real.h only (its
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


# Rule 3, read off the sources without a compiler: comments, literals and
# preprocessor lines are dropped; a statement at namespace scope (outside any
# function, class or initializer body) is a declaration when it ends in ";"
# (a function's, or an extern variable's) and a definition when a body or an
# initializer follows. Names are taken with their namespace; an anonymous
# namespace's and static definitions are file-local, and qualified ones
# (Class::member) are members, which the rule does not cover.
def strip(text):
    # comments, string and character literals, preprocessor lines
    out = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                 lambda m: '""' if m.group(0).startswith('"') else ("''" if m.group(0).startswith("'") else ' '),
                 text, flags=re.S)
    return re.sub(r'^[ \t]*#(?:[^\n]*\\\n)*[^\n]*', '', out, flags=re.M)

ATTR = re.compile(r'\[\[.*?\]\]|\balignas\s*\([^)]*\)')
IDENT = re.compile(r'([A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)*)\s*$')

def name_of(sig):
    sig = ATTR.sub(' ', sig)
    if '(' in sig:
        m = IDENT.search(sig[:sig.index('(')])
        return ('fn', m.group(1)) if m else None
    sig = re.sub(r'=.*$', '', sig, flags=re.S).strip()
    sig = re.sub(r'\[[^\]]*\]\s*$', '', sig).strip()  # an array's bound
    m = IDENT.search(sig)
    return ('var', m.group(1)) if m else None

def scan(path):
    """(namespace, name, kind) declared (';') and defined ('{') at namespace scope."""
    text = strip(path.read_text(errors='replace'))
    stack, start = [], 0
    decls, defs = [], []
    def ns_path():
        if any(s is None for s in stack): return None  # inside a block
        if 'anon' in stack: return 'anon'
        return '::'.join(s for s in stack if s not in ('', 'anon'))
    i = 0
    while i < len(text):
        c = text[i]
        if c == '{':
            stmt = text[start:i].strip()
            ns = ns_path()
            m = re.match(r'^namespace\s*([\w:]*)$', stmt)
            if ns is not None and m:
                stack.append(m.group(1) if m.group(1) else 'anon')
            elif ns is not None and re.match(r'^extern\s*""$', stmt):
                stack.append('')
            else:
                if ns is not None and stmt and not re.match(r'^(struct|class|union|enum|template|typedef|using)\b', stmt):
                    n = name_of(stmt)
                    if n: defs.append((ns, n[1], n[0], stmt))
                # skip the block
                depth, j = 1, i + 1
                while depth and j < len(text):
                    depth += {'{': 1, '}': -1}.get(text[j], 0)
                    j += 1
                i = j
                # an initializer's closing ';' ends the statement
                start = i
                continue
            start = i + 1
        elif c == '}':
            if stack: stack.pop()
            start = i + 1
        elif c == ';':
            stmt = text[start:i].strip()
            ns = ns_path()
            start = i + 1
            if ns is None or not stmt or re.match(r'^(using|typedef|static_assert|friend|struct|class|union|enum|template)\b', stmt):
                i += 1; continue
            n = name_of(stmt)
            if n:
                is_extern = re.search(r'\bextern\b', ATTR.sub(' ', stmt)) is not None
                if n[0] == 'fn' and not re.match(r'^(inline|constexpr|static)\b', ATTR.sub(' ', stmt).strip()):
                    decls.append((ns, n[1], 'fn', stmt))
                elif n[0] == 'var' and is_extern:
                    decls.append((ns, n[1], 'var', stmt))
                elif n[0] == 'var':
                    defs.append((ns, n[1], 'var', stmt))
        i += 1
    return decls, defs


def misplaced_definitions(root):
    hook = root / "hook"
    where = {}
    for cc in sorted(hook.glob("*.cc")):
        for ns, name, _, stmt in scan(cc)[1]:
            if ns == "anon" or re.match(r"^static\b", ATTR.sub(" ", stmt).strip()) or "::" in name:
                continue
            where.setdefault((ns, name), set()).add(cc.name)
    problems = []
    for header in sorted(hook.glob("*.h")):
        own = header.stem + ".cc"
        for ns, name, kind, _ in scan(header)[0]:
            found = sorted(where.get((ns, name), ()))
            if found != [own]:
                what = "function" if kind == "fn" else "variable"
                problems.append(f"{header.relative_to(root)}: declares the {what} {ns}::{name}, defined in "
                                f"{', '.join('hook/' + f for f in found) or 'no hook/ file'}, not in hook/{own} "
                                "(a .cc implements only the header of its own stem)")
    return problems


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
    problems = layer_problems(root) + hook_cycles(root) + misplaced_definitions(root) + by_name_lookups(root)
    for p in problems:
        print(p)
    print(f"layers, hook/ include graph, definitions and driver lookups checked; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
