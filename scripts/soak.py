#!/usr/bin/env python3
"""Soak test: a real `actorllm serve` on the default model under a mixed load for a long
time, recording its footprint.

Clients loop until the time is up, each request one of: streamed over SSE, over the
WebSocket, not streamed, or streamed and then cancelled by id; 30 % of clients leave in the
middle (closing the socket). Every --sample-s seconds the server's RSS, open file
descriptors, KV blocks in use and running / waiting requests go into soak.csv. After the
load: every block must come back, and greedy answers must equal those of the undisturbed
server before the load. soak.svg plots the curves; the summary is printed as JSON.

Standard library only. Usage:
  scripts/soak.py [--minutes 30] [--clients 8] [--sample-s 60] [--out target/soak]
"""

import argparse
import base64
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three primary colors:",
]


def start_server(args):
    cmd = [os.path.join(ROOT, "target/release/actorllm"), "serve", "--port", "0",
           "--max-waiting-requests", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            host, port = m.group(1).rsplit(":", 1)
            return proc, host, int(port)
    raise SystemExit("the server did not start")


def request(host, port, path, body=None, timeout=600):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def metrics(host, port):
    _, text = request(host, port, "/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{")[0]] = float(value)
    return out


def greedy_answers(host, port):
    answers = []
    for p in GREEDY:
        _, data = request(host, port, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})
        answers.append(json.loads(data)["choices"][0]["text"])
    return answers


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}

    def add(self, key):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1


def body(rng):
    b = {"prompt": rng.choice(GREEDY + ["Tell me a story about a robot.", "Explain photosynthesis."]),
         "max_tokens": rng.randint(16, 160), "temperature": rng.choice([0, 0.7, 1.0])}
    return b


def run_sse(host, port, rng, stats, leave, cancel):
    b = body(rng)
    b["stream"] = True
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(b), {"Content-Type": "application/json"})
    r = c.getresponse()
    rid = r.getheader("X-Request-Id")
    events, stop_after = 0, rng.randint(1, 12)
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events += 1
            if line.strip() == b"data: [DONE]":
                stats.add("sse_done")
                break
            if cancel and events == stop_after:
                request(host, port, f"/v1/requests/{rid}/cancel", {})
                stats.add("cancelled")
                cancel = False
            if leave and events == stop_after:
                stats.add("left")
                break
    c.close()


def ws_frame(payload):
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def run_ws(host, port, rng, stats, leave):
    s = socket.create_connection((host, port), timeout=600)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
    buf = buf.split(b"\r\n\r\n", 1)[1]
    msg = {"type": "generate", "id": "s", "endpoint": "completions", "request": body(rng)}
    s.sendall(ws_frame(json.dumps(msg).encode()))
    deltas, stop_after = 0, rng.randint(1, 12)
    while True:
        while len(buf) < 2 or len(buf) < 2 + (buf[1] & 0x7F if buf[1] & 0x7F < 126 else 0):
            chunk = s.recv(65536)
            if not chunk:
                s.close()
                return
            buf += chunk
        n, at = buf[1] & 0x7F, 2
        if n == 126:
            while len(buf) < 4:
                buf += s.recv(65536)
            n, at = int.from_bytes(buf[2:4], "big"), 4
        while len(buf) < at + n:
            buf += s.recv(65536)
        op, payload, buf = buf[0] & 0x0F, buf[at:at + n], buf[at + n:]
        if op == 9:  # ping: answer it
            mask = os.urandom(4)
            s.sendall(bytes([0x8A, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
            continue
        if op != 1:
            continue
        kind = json.loads(payload).get("type")
        if kind == "delta":
            deltas += 1
            if leave and deltas == stop_after:
                stats.add("left")
                break
        elif kind in ("done", "error"):
            stats.add(f"ws_{kind}")
            break
    s.close()


def run_plain(host, port, rng, stats, leave):
    b = body(rng)
    if leave:
        c = socket.create_connection((host, port))
        data = json.dumps(b).encode()
        c.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
        time.sleep(rng.uniform(0.05, 1.5))
        c.close()
        stats.add("left")
        return
    status, _ = request(host, port, "/v1/completions", b)
    stats.add(f"plain_{status}")


def client(host, port, seed, deadline, stats):
    rng = random.Random(seed)
    while time.time() < deadline:
        leave = rng.random() < 0.3
        kind = rng.choice(["sse", "ws", "plain", "cancel"])
        try:
            if kind == "sse":
                run_sse(host, port, rng, stats, leave, False)
            elif kind == "cancel":
                run_sse(host, port, rng, stats, False, True)
            elif kind == "ws":
                run_ws(host, port, rng, stats, leave)
            else:
                run_plain(host, port, rng, stats, leave)
        except (OSError, http.client.HTTPException) as e:
            stats.add(f"client_error:{type(e).__name__}")
        time.sleep(rng.uniform(0.0, 0.5))


def sample(pid, host, port, t0):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    m = metrics(host, port)
    used = m["actorllm:kv_cache_blocks_total"] - m["actorllm:kv_cache_blocks_free"]
    return {"t_min": round((time.time() - t0) / 60, 2), "rss_mib": round(rss, 1), "fds": fds,
            "kv_blocks_used": used, "running": m["vllm:num_requests_running"],
            "waiting": m["vllm:num_requests_waiting"]}


def svg(rows, path):
    series = [("rss_mib", "RSS (MiB)"), ("fds", "open file descriptors"),
              ("kv_blocks_used", "KV blocks in use"), ("running", "running requests")]
    w, h, pad = 420, 180, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * 2}" height="{h * 2}" font-family="sans-serif" font-size="11">']
    tmax = max(r["t_min"] for r in rows) or 1
    for i, (key, title) in enumerate(series):
        ox, oy = (i % 2) * w, (i // 2) * h
        vmax = max(r[key] for r in rows) * 1.1 or 1
        pts = " ".join(f"{ox + pad + (r['t_min'] / tmax) * (w - 2 * pad):.1f},"
                       f"{oy + h - pad - 10 - (r[key] / vmax) * (h - 2 * pad):.1f}" for r in rows)
        parts.append(f'<text x="{ox + pad}" y="{oy + 16}">{title} (0 to {vmax:.0f}) over {tmax:.0f} min</text>')
        parts.append(f'<rect x="{ox + pad}" y="{oy + pad - 10}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#999"/>')
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#1f6feb" stroke-width="1.5"/>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=60)
    ap.add_argument("--out", default=os.path.join(ROOT, "target/soak"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    proc, host, port = start_server(args)
    try:
        before = greedy_answers(host, port)
        stats, t0 = Stats(), time.time()
        deadline = t0 + args.minutes * 60
        threads = [threading.Thread(target=client, args=(host, port, i, deadline, stats), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        rows = [sample(proc.pid, host, port, t0)]
        while time.time() < deadline:
            time.sleep(min(args.sample_s, max(0.0, deadline - time.time())))
            rows.append(sample(proc.pid, host, port, t0))
            print(json.dumps(rows[-1]), flush=True)
        for t in threads:
            t.join(timeout=600)
        for _ in range(600):
            m = metrics(host, port)
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                break
            time.sleep(0.1)
        rows.append(sample(proc.pid, host, port, t0))
        after = greedy_answers(host, port)
        with open(os.path.join(args.out, "soak.csv"), "w") as f:
            f.write(",".join(rows[0]) + "\n")
            f.writelines(",".join(str(r[k]) for k in rows[0]) + "\n" for r in rows)
        svg(rows, os.path.join(args.out, "soak.svg"))
        summary = {
            "minutes": args.minutes, "clients": args.clients, "requests": stats.counts,
            "rss_mib_first_last_max": [rows[0]["rss_mib"], rows[-1]["rss_mib"], max(r["rss_mib"] for r in rows)],
            "fds_first_last_max": [rows[0]["fds"], rows[-1]["fds"], max(r["fds"] for r in rows)],
            "kv_blocks_used_after": rows[-1]["kv_blocks_used"],
            "greedy_identical": before == after,
        }
        print(json.dumps(summary, indent=1))
        ok = summary["kv_blocks_used_after"] == 0 and summary["greedy_identical"]
        sys.exit(0 if ok else 1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
