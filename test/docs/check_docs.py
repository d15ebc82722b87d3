#!/usr/bin/env python3
"""Claims in the docs that can be checked mechanically, checked.

Usage: check_docs.py SOURCE_DIR

- Every relative Markdown link in README.md, CONTRIBUTING.md, docs/ and the
  folders' README.md files names a file or folder of this repository (no link
  leaves the repository, none is dangling), and every #anchor into a Markdown
  file names one of its headings.
- Every repository path written in backticks in those files (`hook/memory.cc`,
  `test/chaos/`, `deploy/prometheus/gpuslice-rules.yaml`) exists, unless it is
  a build output (`build/...`, `<build>/...`).
- README.md's "Layout" section names every top-level folder and no other.
- A name qualified with a layer's namespace (`shm::validate_header`,
  `limiter::Options`, `hook::launch::forget_all_streams()`,
  `platform::monotonic_ns`) names words that the sources of that layer's
  folder use unqualified: a name that moved to another layer (or namespace
  qualifier) is stale wherever the docs still give the old one.
- In CONTRIBUTING.md (its recipes) a name given with its file occurs in that
  file: `name` (`file`...), `name` in `file`, `file`: `name`, and
  `file` (`name`, `name` and ...). Placeholder names of a recipe (`cuFooCreate`)
  are left out.
"""
import pathlib
import re
import subprocess
import sys

root = pathlib.Path(sys.argv[1]).resolve()
problems = []
tracked = subprocess.run(["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True).stdout.split()
if not tracked:  # not a git checkout (a source tarball): every file on disk
    tracked = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
files = set(tracked)
folders = {str(pathlib.PurePosixPath(f).parents[i]) for f in tracked for i in range(len(pathlib.PurePosixPath(f).parents) - 1)}
top = {f.split("/")[0] for f in tracked if "/" in f and not f.startswith(".")}

docs = [p for p in ["README.md", "CONTRIBUTING.md"] if (root / p).exists()]
docs += sorted(f for f in files if f.startswith("docs/") and f.endswith(".md"))
docs += sorted(f for f in files if f.endswith("/README.md") and not f.startswith("docs/"))

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
TOP = ("hook/", "limiter/", "shm/", "include/", "tools/", "test/", "bench/", "deploy/", "docs/", ".ci/")


def anchors(md):
    out = set()
    for line in md.read_text().splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(a)
    return out


def exists(rel):
    rel = rel.rstrip("/")
    return rel in files or rel in folders


def prose_lines(doc):
    """(number, line) of each line of `doc` outside fenced code blocks."""
    in_code_block = False
    for n, line in enumerate((root / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code_block = not in_code_block
            continue
        if not in_code_block:
            yield n, line


for doc in docs:
    path = root / doc
    for n, line in prose_lines(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            target_path, _, anchor = target.partition("#")
            resolved = (path.parent / target_path).resolve() if target_path else path
            try:
                rel = str(resolved.relative_to(root))
            except ValueError:
                problems.append(f"{doc}:{n}: link '{target}' leaves the repository")
                continue
            if target_path and not exists(rel):
                problems.append(f"{doc}:{n}: link '{target}' names no file of the repository")
            elif anchor and rel.endswith(".md") and anchor not in anchors(resolved):
                problems.append(f"{doc}:{n}: link '{target}': no heading '#{anchor}' in {rel}")
        for code in CODE.findall(line):
            c = code.rstrip(".,:;")
            if not c.startswith(TOP) or any(ch in c for ch in "*<>{}$|") or c.endswith("..."):
                continue
            c = c.split(":")[0]
            if not exists(c):
                problems.append(f"{doc}:{n}: `{code}` names no file or folder of the repository")

# Qualified names: the layer's folder must use each part unqualified (a
# definition, or a use inside the namespace), not only as other::name.
LAYER_FOLDER = {"shm": "shm", "limiter": "limiter", "hook": "hook", "platform": "include/platform"}
QUALIFIED = re.compile(r"^(?:gpuslice::)?(shm|limiter|hook|platform)((?:::\w+)+)(?:\(\))?$")
layer_words = {}


def words_of(folder):
    if folder not in layer_words:
        text = "\n".join((root / f).read_text(errors="replace") for f in sorted(files)
                         if f.startswith(folder + "/") and f.endswith((".h", ".cc", ".def")) and (root / f).is_file())
        layer_words[folder] = set(re.findall(r"(?<![:\w])\w+", text))
    return layer_words[folder]


for doc in docs:
    for n, line in prose_lines(doc):
        for code in CODE.findall(line):
            m = QUALIFIED.match(code.rstrip(".,:;"))
            if not m:
                continue
            missing = [w for w in m.group(2).split("::")[1:] if w not in words_of(LAYER_FOLDER[m.group(1)])]
            if missing:
                problems.append(f"{doc}:{n}: `{code}`: {', '.join(missing)} not found in "
                                f"{LAYER_FOLDER[m.group(1)]}/ (moved or renamed?)")

# CONTRIBUTING.md: a name given with its file occurs in it. Paragraphs are
# read as one line, so a claim broken over two lines is seen.
IDENT = r"[A-Za-z_][\w:]*(?:\(\))?"
REPO_PATH = r"(?:hook|limiter|shm|include|tools|test|bench|deploy|docs|\.ci)/[\w./-]*\w"
NAME_THEN_PATH = [re.compile(rf"`({IDENT})` \(`({REPO_PATH})`"), re.compile(rf"`({IDENT})` in `({REPO_PATH})`")]
PATH_THEN_NAME = re.compile(rf"`({REPO_PATH})`: `({IDENT})`")
PATH_THEN_NAMES = re.compile(rf"`({REPO_PATH})` \(((?:`{IDENT}`|[^()`])*)\)")


def named_in(path, name):
    name = name.removesuffix("()").split("::")[-1]
    text = (root / path).read_text(errors="replace")
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


if (root / "CONTRIBUTING.md").exists():
    contributing = (root / "CONTRIBUTING.md").read_text()
    for para in re.split(r"\n\s*\n", contributing):
        flat = re.sub(r"\s*\n\s*", " ", para)
        claims = [(name, path) for pattern in NAME_THEN_PATH for name, path in pattern.findall(flat)]
        claims += [(name, path) for path, name in PATH_THEN_NAME.findall(flat)]
        claims += [(name, m.group(1)) for m in PATH_THEN_NAMES.finditer(flat) for name in re.findall(rf"`({IDENT})`", m.group(2))]
        for name, path in claims:
            if "foo" in name.lower() or not (root / path).is_file():
                continue  # a recipe's placeholder; a missing file is reported above
            if not named_in(path, name):
                at = contributing[:contributing.find(para) + para.find(f"`{name}`")].count("\n") + 1
                problems.append(f"CONTRIBUTING.md:{at}: `{name}` does not occur in `{path}`")

readme = (root / "README.md").read_text()
m = re.search(r"^## Layout\n(.*?)(?=^## )", readme, re.S | re.M)
if not m:
    problems.append("README.md: no '## Layout' section")
else:
    named = set(re.findall(r"`([a-z]+)/`", m.group(1)))
    for f in sorted(top - named):
        problems.append(f"README.md Layout: top-level folder '{f}/' is not described")
    for f in sorted(named - top):
        problems.append(f"README.md Layout: names '{f}/', which does not exist")

for p in problems:
    print(p)
print(f"{len(docs)} documents checked; {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
