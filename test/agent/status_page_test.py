#!/usr/bin/env python3
"""The agent's node status page in a real browser (Debian's headless Chromium).

Usage: status_page_test.py BUILD_DIR CHROMIUM [SCREENSHOT_OUT]

Two containers run on the simulated GPU (one limited to 64 MiB holding 48 MiB
and refused once, one spilling to host memory with a 30 % SM limit); the agent
serves its page. Chromium loads it (scripts run, /api/status is fetched), and:

- the DOM shows the containers with the numbers the regions hold (quota, used
  memory, spill, SM limit, refusals) and the device;
- a screenshot is taken and checked to be a real rendered page (a PNG of the
  window's size with more than a handful of colours, not a blank or an error
  page); it is kept at SCREENSHOT_OUT when given, for a person to look at;
- the page loads nothing from outside the node (no external URL in it).
- a third container, whose region file's name is not UTF-8 and whose name is
  markup, blinds nobody: the page shows every container, that name as text.

Exit 77 (skipped) without Chromium.
"""
import html.parser
import os
import pathlib
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib

MI = 1 << 20
HOSTILE = '<b id="injected">hostile</b>'  # a container name (printable ASCII) that is markup


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cells(html.parser.HTMLParser):
    """Collects <td data-field=...> cells per <tr data-container=...>."""

    def __init__(self):
        super().__init__()
        self.rows, self.row, self.cell, self.ready = {}, None, None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.ready = a.get("data-ready")
        if tag == "tr" and "data-container" in a:
            self.row = self.rows.setdefault(a["data-container"], {})
        if tag == "td" and self.row is not None and "data-field" in a:
            self.cell = a["data-field"]
            self.row[self.cell] = {"attrs": a, "text": ""}

    def handle_endtag(self, tag):
        if tag == "td":
            self.cell = None
        if tag == "tr":
            self.row = None

    def handle_data(self, data):
        if self.row is not None and self.cell:
            self.row[self.cell]["text"] += data


def png_colours(path):
    """(width, height, distinct pixel values in a sample of rows) of an 8-bit RGB(A) PNG."""
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), f"unexpected PNG format {depth}/{colour}"
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + width * channels
    assert len(raw) == stride * height, "truncated PNG"
    # Unfiltered bytes are enough to tell a blank page from a drawn one: count
    # distinct pixel byte strings over every 8th row (filter type 0 rows only,
    # else distinct filtered values, which also differ only on a drawn page).
    seen = set()
    for y in range(0, height, 8):
        row = raw[y * stride + 1:(y + 1) * stride]
        for x in range(0, len(row), channels * 3):
            seen.add(row[x:x + channels])
    return width, height, len(seen)


def main():
    build = os.path.abspath(sys.argv[1])
    chromium = sys.argv[2] if len(sys.argv) > 2 else ""
    keep = sys.argv[3] if len(sys.argv) > 3 else ""
    if not chromium or not os.access(chromium, os.X_OK):
        print("chromium not found: skipped (tools/setup.sh installs Debian's chromium-headless-shell)")
        return 77
    tmp = tempfile.mkdtemp(prefix="gpuslice-page-")
    procs = []
    try:
        env = dict(os.environ, FAKECUDA_STATE=f"{tmp}/fakecuda.state", LD_LIBRARY_PATH=f"{build}/fakecuda")
        regions = pathlib.Path(tmp, "regions")
        pods = {"limited": "aaaaaaaa-1111-4222-8333-000000000001", "spiller": "aaaaaaaa-1111-4222-8333-000000000002"}
        end = f"{tmp}/end"
        ready = []
        for name, ops, options in (
                ("limited", ["alloc", str(48 * MI), "alloc", str(32 * MI)], {"GPUSLICE_MEMORY_LIMIT": "64Mi"}),
                ("spiller", ["alloc", str(16 * MI), "alloc", str(64 * MI)],
                 {"GPUSLICE_MEMORY_LIMIT": "256Mi", "GPUSLICE_OVERSUBSCRIBE": "spill",
                  "GPUSLICE_MEMORY_RESIDENT": "32Mi", "GPUSLICE_SM_LIMIT": "30"})):
            (regions / pods[name]).mkdir(parents=True)
            flag = f"{tmp}/{name}.ready"
            ready.append(flag)
            penv = dict(env, LD_PRELOAD=f"{build}/lib/libgpuslice.so", GPUSLICE_CONTAINER_NAME=name,
                        GPUSLICE_REGION=f"{regions}/{pods[name]}/{name}.region",
                        GPUSLICE_PRIORITY_BOARD=f"{tmp}/board", **options)
            procs.append(subprocess.Popen([f"{build}/bin/cuprobe", "init", "ctx", "0", *ops, "touch", flag,
                                           "waitfile", end], env=penv, stdout=subprocess.DEVNULL))
        # The hostile container: its name is markup, and it renames its region
        # file to bytes that are not UTF-8 (docs/security.md).
        hostile_pod = "aaaaaaaa-1111-4222-8333-000000000003"
        (regions / hostile_pod).mkdir(parents=True)
        ready.append(f"{tmp}/hostile.ready")
        procs.append(subprocess.Popen(
            [f"{build}/bin/cuprobe", "init", "ctx", "0", "alloc", str(4 * MI), "touch", ready[-1], "waitfile", end],
            env=dict(env, LD_PRELOAD=f"{build}/lib/libgpuslice.so", GPUSLICE_CONTAINER_NAME=HOSTILE,
                     GPUSLICE_REGION=f"{regions}/{hostile_pod}/h.region", GPUSLICE_PRIORITY_BOARD=f"{tmp}/board",
                     GPUSLICE_MEMORY_LIMIT="16Mi"), stdout=subprocess.DEVNULL))
        deadline = time.time() + 30
        while not all(os.path.exists(f) for f in ready):
            assert time.time() < deadline, "the containers did not start"
            time.sleep(0.05)
        hostile_dir = os.fsencode(regions / hostile_pod)
        os.rename(hostile_dir + b"/h.region", hostile_dir + b"/\xff\xfe.region")
        port = free_port()
        procs.append(subprocess.Popen([f"{build}/bin/gpuslice-agent", "--region-dir", str(regions), "--interval",
                                       "100ms", "--listen", f"127.0.0.1:{port}", "--nvml",
                                       f"{build}/fakecuda/libnvidia-ml.so.1", "--priority-board", ""],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 30
        while True:
            try:
                page = urllib.request.urlopen(url, timeout=2).read().decode()
                break
            except OSError:
                assert time.time() < deadline, "the agent does not serve its page"
                time.sleep(0.1)
        time.sleep(2.5)  # two history samples for the plots
        external = [w for w in ("http://", "https://", "//cdn", "src=\"/") if w in page.replace(
            "http://www.w3.org/2000/svg", "")]
        assert not external, f"the page refers to something outside itself: {external}"

        profile = f"{tmp}/chromium-profile"
        common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  f"--user-data-dir={profile}", "--window-size=1600,700", "--virtual-time-budget=4000"]
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=90)
        cells = Cells()
        cells.feed(dom.stdout)
        assert cells.ready == "1", f"the page did not render its data:\n{dom.stdout[:2000]}\n{dom.stderr[-2000:]}"
        limited, spiller = cells.rows.get("limited"), cells.rows.get("spiller")
        assert limited and spiller, f"containers missing from the page: {sorted(cells.rows)}"
        assert float(limited["memory"]["attrs"]["data-quota"]) == 64 * MI, limited["memory"]
        assert float(limited["memory"]["attrs"]["data-used"]) == 48 * MI, limited["memory"]
        assert limited["memory"]["text"].startswith("48.0 MiB / 64.0 MiB"), limited["memory"]["text"]
        assert limited["oom_refusals"]["text"] == "1", limited["oom_refusals"]
        assert limited["pod_uid"]["attrs"]["data-value"] == pods["limited"], limited["pod_uid"]
        assert float(spiller["spilled"]["attrs"]["data-value"]) > 0, spiller["spilled"]
        assert spiller["sm"]["attrs"]["data-limit"] == "30", spiller["sm"]
        assert "/ 30 %" in spiller["sm"]["text"], spiller["sm"]["text"]
        assert limited["priority"]["text"] == "normal", limited["priority"]
        assert "1 region" not in dom.stdout and "3 region(s)" in dom.stdout, "agent summary line"
        hostile = cells.rows.get(HOSTILE)
        assert hostile, f"the hostile container is missing from the page: {sorted(cells.rows)}"
        assert hostile["container"]["text"] == HOSTILE, hostile["container"]
        assert float(hostile["memory"]["attrs"]["data-quota"]) == 16 * MI, hostile["memory"]
        assert '<b id="injected">' not in dom.stdout, "the container's name became markup"

        shot = f"{tmp}/status.png"
        r = subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=90)
        assert os.path.exists(shot), f"no screenshot: {r.stderr[-2000:]}"
        width, height, colours = png_colours(shot)
        assert (width, height) == (1600, 700), (width, height)
        assert colours > 20, f"the screenshot looks blank ({colours} colours)"
        if keep:
            shutil.copy(shot, keep)
        print(f"status page: 3 containers checked in the DOM; screenshot {width}x{height}, {colours} colours"
              + (f", kept at {keep}" if keep else ""))
        return 0
    except AssertionError as e:
        print("FAIL:", e)
        return 1
    finally:
        pathlib.Path(tmp, "end").touch()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
