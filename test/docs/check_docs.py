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
  `options::Options`, `hook::launch::forget_all_streams()`,
  `platform::monotonic_ns`) names words that the sources of that layer's
  folder use unqualified: a name that moved to another layer (or namespace
  qualifier) is stale wherever the docs still give the old one.
- In CONTRIBUTING.md (its recipes) a name given with its file occurs in that
  file: `name` (`file`...), `name` in `file`, `file`: `name`, and
  `file` (`name`, `name` and ...). Placeholder names of a recipe (`cuFooCreate`)
  are left out.

Docs say what is; logs say what happened (CONTRIBUTING.md, "Docs and logs"):

- A design doc (docs/*.md) holds at most its budget of lines (BUDGET below:
  400 unless a doc is listed with the reason it needs more).
- A design doc holds no dated run log. A run log shows itself in its
  headings, so every heading outside code blocks is refused if it carries a
  date (`2026-11-26`), a commit (a 7-to-40-digit hex word with a digit and a
  letter, such as `c2bdbbc`) or a numbered stop or round of work ("second
  stop", "next round"). Headings, not prose: prose may date one current
  figure ("measured 2026-11-24 at 5583f5d"), which is what a doc's table of
  current figures must do; a heading that dates a section is the start of a
  log appended to a doc. It was chosen over counting dates in prose because
  a current table legitimately carries several.
- A design doc links into docs/log/ only on its "History:" line: a log is
  never cited as the truth.
- Every docs/log/*.md is named YYYY-MM-DD-topic.md, says in its first lines
  that it is a log ("A log, not the truth"), and is append-only: where git
  knows the version that added it, that version is a prefix of today's.
  Logs are verbatim history, so their links and paths (of their day) are not
  checked.
- tools/size.py runs, and the table of docs/size.md has its rows.
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
docs += sorted(f for f in files if f.startswith("docs/") and f.endswith(".md") and not f.startswith("docs/log/"))
design_docs = sorted(f for f in files if f.startswith("docs/") and f.count("/") == 1 and f.endswith(".md"))
logs = sorted(f for f in files if f.startswith("docs/log/") and f.endswith(".md"))
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

# Docs say what is; logs say what happened.
DEFAULT_BUDGET = 400
BUDGET = {
    # The page of every benchmark: each section its method and current figures.
    "docs/benchmarks.md": 500,
    # The limiter's design: control law, queue bound, priced launches, hot path.
    "docs/limiter.md": 500,
    # The proof that every path is counted exactly or conservatively.
    "docs/memory-accounting.md": 540,
    # Every counted family, what the driver holds and when it is counted.
    "docs/memory.md": 600,
    # Every install path (Kubernetes, CDI, podman, bare metal, HAMi migration).
    "docs/deploy.md": 600,
    # Priority: the board, the launch path, the many tenants' timetable, threats.
    "docs/priority.md": 420,
}
DATED_HEADING = [
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"), "a commit"),
    (re.compile(r"\b(first|second|third|fourth|fifth|sixth|next|\d+(st|nd|rd|th))\s+(stop|round)\b", re.I),
     "a stop or round of work"),
]
LOG_LINK = re.compile(r"\]\((?:\.\./)*(?:docs/)?log/")
for doc in design_docs:
    n_lines = len((root / doc).read_text().splitlines())
    budget = BUDGET.get(doc, DEFAULT_BUDGET)
    if n_lines > budget:
        problems.append(f"{doc}: {n_lines} lines, over its budget of {budget} (move what happened to docs/log/)")
    for n, line in prose_lines(doc):
        if line.startswith("#"):
            for pattern, what in DATED_HEADING:
                if pattern.search(line):
                    problems.append(f"{doc}:{n}: heading with {what} ('{line.strip()}'): "
                                    "a dated run belongs in docs/log/")
        if LOG_LINK.search(line) and not line.startswith("History:"):
            problems.append(f"{doc}:{n}: links into docs/log/ outside its 'History:' line (a log is not the truth)")
for log in logs:
    name = pathlib.PurePosixPath(log).name
    text = (root / log).read_text()
    if not re.match(r"20\d\d-\d\d-\d\d-[\w.-]+\.md$", name):
        problems.append(f"{log}: a log's name is YYYY-MM-DD-topic.md")
    if "A log, not the truth" not in "\n".join(text.splitlines()[:8]):
        problems.append(f"{log}: its first lines must say 'A log, not the truth'")
    added = subprocess.run(["git", "-C", str(root), "log", "--diff-filter=A", "--format=%H", "--", log],
                           capture_output=True, text=True).stdout.split()
    if added:
        first = subprocess.run(["git", "-C", str(root), "show", f"{added[-1]}:{log}"], capture_output=True, text=True)
        if first.returncode == 0 and not text.startswith(first.stdout):
            problems.append(f"{log}: changed, not appended to, since {added[-1][:7]} (logs are append-only)")
size = subprocess.run([sys.executable, str(root / "tools/size.py"), str(root)], capture_output=True, text=True)
if size.returncode != 0 or "| all |" not in size.stdout:
    problems.append(f"tools/size.py failed (exit {size.returncode}): {size.stderr.strip()}")
elif (root / "docs/size.md").exists():
    rows = lambda text: re.findall(r"^\| ([^|]+?) \|", text, re.M)
    if rows(size.stdout) != [r for r in rows((root / "docs/size.md").read_text())]:
        problems.append("docs/size.md: its table's rows are not tools/size.py's (run tools/size.py --write)")

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
