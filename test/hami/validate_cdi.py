#!/usr/bin/env python3
"""Validates CDI spec files against the vendored CDI JSON schema
(cdi-schema/, see its README.md), plus what the schema does not express but
container runtimes enforce when they load a spec: a released cdiVersion no
lower than what the content needs (pkg/cdi/version.go, MinimumRequiredVersion),
the naming rules of container-device-interface pkg/parser for the kind and the
device names, NAME=value environment entries, absolute mount paths, and no
unknown fields (runtimes refuse specs with unknown fields).

Usage: validate_cdi.py SCHEMA_DIR SPEC.json...  -- one line per problem;
exit 0 valid, 1 invalid, 77 without the jsonschema module.
"""
import json
import pathlib
import re
import sys

try:
    import jsonschema
except ImportError:
    print("python3 jsonschema not installed: skipped (pip install -r test/hami/requirements.txt)")
    sys.exit(77)

VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
TOP = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_KEYS = {"name", "annotations", "containerEdits"}
EDITS = {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices"}
MOUNT_KEYS = {"hostPath", "containerPath", "options", "type"}


def validator(schema_dir):
    schema_dir = pathlib.Path(schema_dir)
    schema = json.loads((schema_dir / "schema.json").read_text())
    defs = json.loads((schema_dir / "defs.json").read_text())
    try:
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT7
        registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
        return jsonschema.Draft7Validator(schema, registry=registry)
    except ImportError:  # jsonschema < 4.18
        resolver = jsonschema.RefResolver(base_uri="", referrer=schema, store={"defs.json": defs})
        return jsonschema.Draft7Validator(schema, resolver=resolver)


RELEASED = {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"}


def required_version(spec):
    """container-device-interface pkg/cdi/version.go requiresV040..V070 (the
    fields gpuslice may write; later versions add fields it never writes)."""
    devices = [d for d in spec.get("devices", []) if isinstance(d, dict)]
    edits = [d.get("containerEdits", {}) for d in devices] + [spec.get("containerEdits", {})]
    edits = [e for e in edits if isinstance(e, dict)]
    if any(e.get("intelRdt") for e in edits):
        return (0, 7, 0)
    kind = str(spec.get("kind", ""))
    cls = kind.split("/", 1)[1] if "/" in kind else ""
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in cls:
        return (0, 6, 0)
    if any(str(d.get("name", "x"))[:1] and not str(d.get("name", "x"))[:1].isalpha() for d in devices):
        return (0, 5, 0)
    if any(n.get("hostPath") for e in edits for n in e.get("deviceNodes", []) if isinstance(n, dict)):
        return (0, 5, 0)
    if any(mnt.get("type") for e in edits for mnt in e.get("mounts", []) if isinstance(mnt, dict)):
        return (0, 4, 0)
    return (0, 3, 0)


def semantic(spec, problem):
    if not isinstance(spec, dict):
        return
    for k in spec.keys() - TOP:
        problem(f"unknown field {k!r}")
    m = SEMVER.match(str(spec.get("cdiVersion", "")))
    if not m:
        problem(f"cdiVersion {spec.get('cdiVersion')!r} is not semver MAJOR.MINOR.PATCH")
    elif m.group(0) not in RELEASED:
        problem(f"cdiVersion {spec['cdiVersion']} is not a released CDI spec version")
    else:
        need = required_version(spec)
        if tuple(map(int, m.groups())) < need:
            problem(f"cdiVersion {spec['cdiVersion']} is older than {'.'.join(map(str, need))}, "
                    "which the spec's content needs")
    kind = str(spec.get("kind", ""))
    parts = kind.split("/")
    if len(parts) != 2 or not all(VENDOR_OR_CLASS.match(p) for p in parts):
        problem(f"kind {kind!r} is not <vendor>/<class> under CDI's naming rules")
    names = set()
    for dev in spec.get("devices", []):
        for k in dev.keys() - DEVICE_KEYS:
            problem(f"device: unknown field {k!r}")
        name = str(dev.get("name", ""))
        if not DEVICE.match(name):
            problem(f"device name {name!r} breaks CDI's naming rules")
        if name in names:
            problem(f"device name {name!r} twice")
        names.add(name)
        edits = dev.get("containerEdits", {})
        for k in edits.keys() - EDITS:
            problem(f"device {name}: unknown containerEdits field {k!r}")
        for e in edits.get("env", []):
            if not isinstance(e, str) or not ENV.match(e):
                problem(f"device {name}: env entry {e!r} is not NAME=value")
        for mnt in edits.get("mounts", []):
            for k in mnt.keys() - MOUNT_KEYS:
                problem(f"device {name}: unknown mount field {k!r}")
            for p in ("hostPath", "containerPath"):
                if not str(mnt.get(p, "")).startswith("/"):
                    problem(f"device {name}: mount {p} {mnt.get(p)!r} is not absolute")


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    v = validator(sys.argv[1])
    bad = 0
    for path in sys.argv[2:]:
        problems = []
        try:
            spec = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"cannot read JSON: {e}")
            spec = None
        if spec is not None:
            for err in sorted(v.iter_errors(spec), key=lambda e: list(e.path)):
                problems.append(f"schema: {'/'.join(map(str, err.path)) or '(top)'}: {err.message}")
            semantic(spec, problems.append)
        for p in problems:
            print(f"{path}: {p}")
        bad += bool(problems)
    print(f"{len(sys.argv) - 2} spec(s), {bad} invalid")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
