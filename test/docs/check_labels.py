#!/usr/bin/env python3
"""test/README.md's taxonomy of the tests, checked on a build's tests.

Usage: check_labels.py SOURCE_DIR BUILD_DIR [CTEST]

- Every CTest test of the build carries exactly one kind label from the table
  "| kind | ..." of test/README.md, and every other label it carries is one of
  the table "| label | ...".
- Every folder test/CMakeLists.txt adds has a row in the folder table
  "| folder | ..." of test/README.md.

Exit 0 when all hold, 1 with one line per problem otherwise.
"""
import json
import pathlib
import re
import subprocess
import sys


def table(text, header):
    """The backticked words of the first cell of each row of the table whose
    header row starts with `| header |`."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(f"| {header} |"):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            if set(line) <= set("|-: "):
                continue
            rows.append(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return rows


def main():
    root, build = pathlib.Path(sys.argv[1]), sys.argv[2]
    ctest = sys.argv[3] if len(sys.argv) > 3 else "ctest"
    readme = (root / "test/README.md").read_text()
    kinds = {w for row in table(readme, "kind") for w in row}
    others = {w for row in table(readme, "label") for w in row}
    folders = {w.rstrip("/") for row in table(readme, "folder") for w in row}
    problems = []
    if not kinds:
        problems.append("test/README.md: no '| kind |' table")

    listed = subprocess.run([ctest, "--test-dir", build, "-N", "--show-only=json-v1"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        print(f"check_labels: {ctest} -N failed in {build}: {listed.stderr.strip()}")
        return 1
    tests = json.loads(listed.stdout).get("tests", [])
    if not tests:
        problems.append(f"{build}: no tests listed")
    for test in tests:
        labels = []
        for prop in test.get("properties", []):
            if prop["name"] == "LABELS":
                labels = prop["value"]
        own = [l for l in labels if l in kinds]
        if len(own) != 1:
            problems.append(f"{test['name']}: {len(own)} kind labels ({', '.join(own) or 'none'}) among {labels};"
                            f" expected exactly one of {', '.join(sorted(kinds))} (test/README.md)")
        for label in labels:
            if label not in kinds and label not in others:
                problems.append(f"{test['name']}: label '{label}' is neither a kind nor another label of"
                                " test/README.md")

    cmake = (root / "test/CMakeLists.txt").read_text()
    added = re.search(r"foreach\(dir\n(.*?)\)", cmake, re.S)
    for folder in (added.group(1).split() if added else []):
        if (root / "test" / folder / "CMakeLists.txt").exists() and f"test/{folder}" not in folders:
            problems.append(f"test/{folder}: no row in test/README.md's folder table")

    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
