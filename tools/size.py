#!/usr/bin/env python3
"""Lines of the repository by part, as a Markdown table (docs/size.md).

Usage: tools/size.py [SOURCE_DIR] [--write]

Counts the lines of every file git tracks (or, outside a git checkout, every
file on disk), sorted into parts by path, the first rule that matches:

  docs (log)   docs/log/: dated runs and investigations, append-only
  docs         docs/, README.md, CONTRIBUTING.md, every other *.md
  simulator    test/fakecuda/: the simulated driver
  tests        test/: the tests, their programs and scripts
  bench        bench/, tools/bench/: benchmarks
  product      hook/, limiter/, shm/, include/, tools/: what ships
  deploy       deploy/: manifests, units, rules
  build and CI everything else (CMake, .ci/, formatter settings)

Binary files and files without a newline-terminated line count as what
`wc -l` says. Prints the table on stdout; with --write, replaces the table in
docs/size.md (between its "<!-- size:begin -->" and "<!-- size:end -->"
lines) and the line naming the commit and date it was made at. The table
makes growth visible; it is not a test: nothing fails when it is stale.
"""
import datetime
import pathlib
import subprocess
import sys

PARTS = [
    ("product", "hook/, limiter/, shm/, include/, tools/ (but tools/bench/)"),
    ("simulator", "test/fakecuda/"),
    ("tests", "test/ (but test/fakecuda/)"),
    ("bench", "bench/, tools/bench/"),
    ("deploy", "deploy/"),
    ("build and CI", "CMake files, .ci/, settings"),
    ("docs", "docs/*.md, README.md, CONTRIBUTING.md, folders' *.md"),
    ("docs (log)", "docs/log/"),
]


def part_of(path):
    if path.startswith("docs/log/"):
        return "docs (log)"
    if path.startswith("docs/") or path.endswith(".md"):
        return "docs"
    if path.startswith("test/fakecuda/"):
        return "simulator"
    if path.startswith("test/"):
        return "tests"
    if path.startswith(("bench/", "tools/bench/")):
        return "bench"
    if path.startswith(("hook/", "limiter/", "shm/", "include/", "tools/")):
        return "product"
    if path.startswith("deploy/"):
        return "deploy"
    return "build and CI"


def tracked(root):
    out = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split("\n")
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]


def table(root):
    files = {name: 0 for name, _ in PARTS}
    lines = {name: 0 for name, _ in PARTS}
    for rel in tracked(root):
        path = root / rel
        if not rel or not path.is_file():
            continue
        part = part_of(rel)
        files[part] += 1
        lines[part] += path.read_bytes().count(b"\n")
    rows = ["| part | what | files | lines |", "|---|---|---:|---:|"]
    for name, what in PARTS:
        rows.append(f"| {name} | {what} | {files[name]:,} | {lines[name]:,} |")
    rows.append(f"| all | | {sum(files.values()):,} | {sum(lines.values()):,} |")
    return "\n".join(rows) + "\n"


def stamp(root):
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True,
                           text=True).stdout.strip()
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"Made by `tools/size.py` at commit {commit}{' with changes not yet committed' if dirty else ''}, {day}."


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    root = pathlib.Path(args[0] if args else pathlib.Path(__file__).resolve().parents[1]).resolve()
    text = table(root)
    if "--write" not in argv:
        sys.stdout.write(text)
        return 0
    doc = root / "docs/size.md"
    old = doc.read_text()
    begin, end = "<!-- size:begin -->\n", "<!-- size:end -->\n"
    if begin not in old or end not in old:
        print(f"tools/size.py: {doc} has no '{begin.strip()}' ... '{end.strip()}' lines", file=sys.stderr)
        return 1
    head, rest = old.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + begin + stamp(root) + "\n\n" + text + end + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
