#!/usr/bin/env python3
"""Offline checks of deploy/: every YAML document parses, Kubernetes objects
carry the fields the gpuslice node setup relies on (the agent, the HAMi
drop-in and its kustomize overlay, DRA claim templates and the pods using
them), and the systemd unit runs the agent. (kubectl --dry-run would need a cluster; yamllint runs first.)

Usage: check_manifests.py [--rendered] DEPLOY_DIR   -- prints one line per problem, exit 1 if any.
"""
import configparser
import pathlib
import re
import sys

import yaml

REGION_DIR = "/run/gpuslice/regions"
HAMI_ROOT = "/usr/local/vgpu"  # <hook path>/vgpu of HAMi's device plugin (HOOK_PATH=/usr/local)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
SIZE = re.compile(r"^[0-9]+(B|K|k|M|G|T|Ki|Mi|Gi|Ti)?B?$")
problems = []


def problem(where, what):
    problems.append(f"{where}: {what}")


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def check_daemonset(where, ds, services):
    spec = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"].get("labels", {})
    if ds["spec"]["selector"]["matchLabels"].items() - labels.items():
        problem(where, "selector does not match the pod template's labels")
    if spec.get("hostPID") is not True:
        problem(where, "hostPID must be true (NVML reports host pids; the agent maps namespaces through /proc)")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    agents = [c for c in spec["containers"] if is_agent(c)]
    if len(agents) != 1:
        problem(where, "expected exactly one container running gpuslice-agent")
        return
    agent = agents[0]
    args = " ".join(agent.get("args", []))
    m = re.search(r"--region-dir[= ](\S+)", args)
    if not m:
        problem(where, "the agent needs --region-dir")
    else:
        mounted = {vm["mountPath"]: vm["name"] for vm in agent.get("volumeMounts", [])}
        vol = volumes.get(mounted.get(m.group(1), ""), {})
        if vol.get("hostPath", {}).get("path") != REGION_DIR:
            problem(where, f"--region-dir {m.group(1)} must be a mount of the hostPath {REGION_DIR}")
    listen = re.search(r"--listen[= ](\S+)", args)
    ports = {p.get("name"): p for p in agent.get("ports", [])}
    if "metrics" not in ports:
        problem(where, "the agent needs a container port named 'metrics' (ServiceMonitor)")
    elif listen and not listen.group(1).endswith(":" + str(ports["metrics"]["containerPort"])):
        problem(where, f"--listen {listen.group(1)} does not match the metrics port")
    elif listen and listen.group(1).startswith("127."):
        problem(where, "--listen on loopback: the kubelet's probe and Prometheus cannot reach it")
    probe = agent.get("livenessProbe", {}).get("httpGet", {})
    if probe.get("path") != "/healthz" or probe.get("port") not in ("metrics", ports.get("metrics", {}).get("containerPort")):
        problem(where, "livenessProbe must be an HTTP GET of /healthz on the metrics port")
    req = agent.get("resources", {}).get("requests", {})
    if "cpu" not in req or "memory" not in req:
        problem(where, "the agent needs cpu and memory requests")
    if "memory" not in agent.get("resources", {}).get("limits", {}):
        problem(where, "the agent needs a memory limit")
    caps = agent.get("securityContext", {}).get("capabilities", {}).get("add", [])
    if "SYS_PTRACE" not in caps and not agent.get("securityContext", {}).get("privileged"):
        problem(where, "the agent needs CAP_SYS_PTRACE to read other processes' /proc/<pid>/ns/pid")
    hami = re.search(r"--hami-root[= ](\S+)", args)
    if hami:
        check_hami_mount(where, agent, volumes, hami.group(1))
    if env_of(agent).get("NVIDIA_VISIBLE_DEVICES", {}).get("value") != "all":
        problem(where, "NVIDIA_VISIBLE_DEVICES=all: NVML from the NVIDIA container runtime, without taking a GPU")
    for svc_where, svc in services:
        sel = svc["spec"].get("selector", {})
        if sel and not (sel.items() - labels.items()):
            if "metrics" not in [p.get("name") for p in svc["spec"].get("ports", [])]:
                problem(svc_where, "the agent's Service needs a port named 'metrics'")
            return
    problem(where, "no Service selects the agent's pods")


def check_hami_mount(where, container, volumes, root):
    mounted = {vm["mountPath"]: vm["name"] for vm in container.get("volumeMounts", [])}
    vol = volumes.get(mounted.get(root, ""), {})
    if vol.get("hostPath", {}).get("path") != HAMI_ROOT:
        problem(where, f"--hami-root {root} must be a mount of the hostPath {HAMI_ROOT} (HAMi's <hook path>/vgpu)")


def is_agent(container):
    return "gpuslice-agent" in " ".join(container.get("command", []) + container.get("args", []))


def check_dropin(where, ds):
    """The DaemonSet that installs libgpuslice.so as HAMi's libvgpu.so."""
    spec = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"].get("labels", {})
    if ds["spec"]["selector"]["matchLabels"].items() - labels.items():
        problem(where, "selector does not match the pod template's labels")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("containers", []):
        script = " ".join(c.get("command", []) + c.get("args", []))
        mounts = {vm["name"]: vm["mountPath"] for vm in c.get("volumeMounts", [])}
        host = {n: volumes.get(n, {}).get("hostPath", {}).get("path") for n in mounts}
        target = [mounts[n] for n, p in host.items() if p == HAMI_ROOT]
        if not target:
            problem(where, f"container {c['name']}: mount the hostPath {HAMI_ROOT} (where HAMi's libvgpu.so lives)")
            continue
        if "libgpuslice.so" not in script or "libvgpu.so" not in script:
            problem(where, f"container {c['name']}: must copy libgpuslice.so onto libvgpu.so")
        if "gpuslice-install-library --protect" not in script:
            problem(where, f"container {c['name']}: install with gpuslice-install-library --protect (by rename, "
                    "immutable against HAMi's in-place cp)")
        if "LINUX_IMMUTABLE" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            problem(where, f"container {c['name']}: needs the LINUX_IMMUTABLE capability (chattr +i)")
        if "ld.so.preload" not in script:
            problem(where, f"container {c['name']}: make sure {HAMI_ROOT}/ld.so.preload names the library")
        if "memory" not in c.get("resources", {}).get("limits", {}):
            problem(where, f"container {c['name']}: needs a memory limit")


def check_kustomization(where, k, root, path):
    base = path.parent
    for r in k.get("resources", []):
        target = base / r
        if not (target.is_file() or (target / "kustomization.yaml").is_file()):
            problem(where, f"resource {r} is neither a file nor a kustomization directory")
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch.get("patch", "")) or []
        text = yaml.safe_dump(ops)
        if "--hami-root" in text:
            root_arg = re.search(r"--hami-root=(\S+)", text).group(1)
            added = [o["value"] for o in ops if isinstance(o.get("value"), dict)]
            mount = [v for v in added if v.get("mountPath") == root_arg]
            volume = [v for v in added if v.get("hostPath", {}).get("path") == HAMI_ROOT]
            if not mount or not volume or mount[0]["name"] != volume[0]["name"]:
                problem(where, f"the --hami-root={root_arg} patch must mount the hostPath {HAMI_ROOT} there")


def check_claim_template(where, t):
    if t.get("apiVersion") != "resource.k8s.io/v1":
        problem(where, "ResourceClaimTemplate: use resource.k8s.io/v1 (GA since Kubernetes 1.34)")
    reqs = t.get("spec", {}).get("spec", {}).get("devices", {}).get("requests", [])
    if not reqs:
        problem(where, "ResourceClaimTemplate: no device request")
    for r in reqs:
        if not DNS_LABEL.match(r.get("name", "")):
            problem(where, f"request name {r.get('name')!r} is not a DNS label")
        exactly = r.get("exactly", {})
        if not exactly.get("deviceClassName"):
            problem(where, f"request {r.get('name')}: exactly.deviceClassName missing")
        for cap, q in exactly.get("capacity", {}).get("requests", {}).items():
            if not isinstance(q, str) or not QUANTITY.match(q):
                problem(where, f"request {r.get('name')}: capacity {cap}={q!r} is not a quoted quantity")


def check_workload(where, pod_spec, configmaps, claim_templates=()):
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    claims = {c["name"]: c for c in pod_spec.get("resourceClaims", [])}
    for name, c in claims.items():
        tpl = c.get("resourceClaimTemplateName")
        if tpl is not None and tpl not in claim_templates:
            problem(where, f"resourceClaims {name}: no ResourceClaimTemplate {tpl} in deploy/")
    for c in pod_spec["containers"]:
        for ref in c.get("resources", {}).get("claims", []):
            if ref.get("name") not in claims:
                problem(f"{where} container {c['name']}", f"claims {ref.get('name')!r}, not in the pod's resourceClaims")
        env = env_of(c)
        mounts = c.get("volumeMounts", [])
        preload = "LD_PRELOAD" in env and "libgpuslice.so" in env["LD_PRELOAD"].get("value", "")
        for vm in mounts:
            if vm["mountPath"] == "/etc/ld.so.preload":
                cm = volumes.get(vm["name"], {}).get("configMap", {}).get("name")
                data = configmaps.get(cm, {}).get(vm.get("subPath", ""), "")
                preload = preload or "libgpuslice.so" in data
        if not preload:
            continue
        cw = f"{where} container {c['name']}"
        lib = [vm for vm in mounts if vm["mountPath"] == "/usr/local/gpuslice/lib"]
        if not lib or not lib[0].get("readOnly"):
            problem(cw, "mount the library directory read-only at /usr/local/gpuslice/lib")
        region = env.get("GPUSLICE_REGION", {}).get("value")
        if not region:
            problem(cw, "GPUSLICE_REGION must name the region (the default /dev/shm path is invisible to the agent)")
            continue
        holder = [vm for vm in mounts if region.startswith(vm["mountPath"].rstrip("/") + "/")]
        if not holder:
            problem(cw, f"GPUSLICE_REGION {region} is not on a mounted volume")
            continue
        vol = volumes.get(holder[0]["name"], {})
        if vol.get("hostPath", {}).get("path") != REGION_DIR:
            problem(cw, f"the region's volume must be the hostPath {REGION_DIR}")
        if "$(POD_UID)" not in holder[0].get("subPathExpr", "") or "POD_UID" not in env:
            problem(cw, "mount the region directory with subPathExpr $(POD_UID) (one directory per pod)")
        mem = env.get("GPUSLICE_MEMORY_LIMIT", {}).get("value")
        if mem is not None and not SIZE.match(mem):
            problem(cw, f"GPUSLICE_MEMORY_LIMIT {mem!r} is not a size")
        sm = env.get("GPUSLICE_SM_LIMIT", {}).get("value")
        if sm is not None and not (sm.rstrip("%").isdigit() and 1 <= int(sm.rstrip("%")) <= 100):
            problem(cw, f"GPUSLICE_SM_LIMIT {sm!r} is not 1-100")


def check_systemd(path):
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(path)
    exec_start = unit.get("Service", "ExecStart", fallback="")
    if "gpuslice-agent" not in exec_start or f"--region-dir={REGION_DIR}" not in exec_start:
        problem(path, f"ExecStart must run gpuslice-agent --region-dir={REGION_DIR}")
    if unit.get("Service", "Restart", fallback="") not in ("always", "on-failure"):
        problem(path, "Restart=always: the agent is stateless and must come back")
    if not unit.has_section("Install") or not unit.get("Install", "WantedBy", fallback=""):
        problem(path, "[Install] WantedBy= missing")


def main():
    # --rendered: the output of `kubectl kustomize` of one overlay (no systemd
    # unit, no example workload expected).
    rendered = "--rendered" in sys.argv[1:]
    root = pathlib.Path([a for a in sys.argv[1:] if a != "--rendered"][0])
    docs = []
    files = sorted(list(root.rglob("*.yaml")) + list(root.rglob("*.yml")))
    if not files:
        problem(root, "no YAML files")
    paths = {}
    for f in files:
        try:
            for i, doc in enumerate(yaml.safe_load_all(f.read_text())):
                if doc is not None:
                    docs.append((f"{f.relative_to(root)}#{i}", doc))
                    paths[f"{f.relative_to(root)}#{i}"] = f
        except yaml.YAMLError as e:
            problem(f, f"does not parse: {e}")
    kube = [(w, d) for w, d in docs if isinstance(d, dict) and "kind" in d]
    for w, d in kube:
        for field in ("apiVersion", "kind"):
            if not d.get(field):
                problem(w, f"missing {field}")
        if d["kind"] == "Kustomization":
            check_kustomization(w, d, root, paths[w])
        elif not d.get("metadata", {}).get("name"):
            problem(w, "missing metadata.name")
    services = [(w, d) for w, d in kube if d["kind"] == "Service"]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for w, d in kube if d["kind"] == "ConfigMap"}
    daemonsets = [(w, d) for w, d in kube if d["kind"] == "DaemonSet"]
    if not daemonsets:
        problem(root, "no DaemonSet for the agent")
    for w, d in daemonsets:
        if any(is_agent(c) for c in d["spec"]["template"]["spec"]["containers"]):
            check_daemonset(w, d, services)
        else:
            check_dropin(w, d)
    templates = {}
    for w, d in kube:
        if d["kind"] == "ResourceClaimTemplate":
            check_claim_template(w, d)
            templates[d["metadata"]["name"]] = d
    workloads = 0
    for w, d in kube:
        if d["kind"] == "Pod":
            check_workload(w, d["spec"], configmaps, templates)
            workloads += 1
        elif d["kind"] in ("Deployment", "StatefulSet", "Job"):
            check_workload(w, d["spec"]["template"]["spec"], configmaps, templates)
            workloads += 1
    if workloads == 0 and not rendered:
        problem(root, "no example workload")
    for w, d in kube:
        if d["kind"] == "ServiceMonitor":
            eps = d["spec"].get("endpoints", [])
            if not any(e.get("port") == "metrics" and e.get("path", "/metrics") == "/metrics" for e in eps):
                problem(w, "ServiceMonitor must scrape port 'metrics' at /metrics")
    units = sorted(root.rglob("*.service"))
    if not units and not rendered:
        problem(root, "no systemd unit")
    for u in units:
        check_systemd(u)
    for p in problems:
        print(p)
    print(f"{len(files)} YAML files, {len(docs)} documents, {len(units)} systemd units: "
          f"{'OK' if not problems else str(len(problems)) + ' problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
