#!/usr/bin/env python3
"""Server memory per client connection and per open call, from its RSS.

Opens idle HTTP/2 connections to a running idempotencyd (preface and SETTINGS
exchanged, nothing else), has each serve one call (what a pooled client keeps
open: buffers that stay once used), then opens calls that stay in flight (a
Health/Check whose request message never comes), reading the server's VmRSS
from /proc/PID/status before and after each step.

    bench/connections.py --pid PID --addr 127.0.0.1:50051 [--tls] \
        [--connections 1000] [--streams-connections 10] [--streams 100] [--resets 900]

With --resets N it then also pauses the server (SIGSTOP), sends N calls each
cancelled at once on one connection, resumes it (SIGCONT), and reports the
peak RSS (VmHWM) growth and whether the connection survived.

The server's --max-connections and --max-concurrent-streams must allow what is
asked. Prints one line per step: RSS before, after, and the cost per unit.
"""

import argparse
import os
import signal
import socket
import ssl
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def check_headers(stream):
    def literal(index, value):
        head = bytes([index]) if index < 15 else bytes([0x0F, index - 15])
        return head + bytes([len(value)]) + value

    block = b"\x83\x86" + literal(4, b"/grpc.health.v1.Health/Check") + literal(1, b"localhost")
    block += literal(31, b"application/grpc") + b"\x00\x02te\x08trailers"
    return frame(0x1, 0x4, stream, block)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def connect(addr, tls):
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        sock = context.wrap_socket(sock, server_hostname=host)
    sock.sendall(PREFACE + frame(0x4, 0, 0))
    while True:  # the server's SETTINGS
        header = read_exact(sock, 9)
        length = int.from_bytes(header[:3], "big")
        read_exact(sock, length)
        if header[3] == 0x4 and header[4] & 1 == 0:
            break
    sock.sendall(frame(0x4, 0x1, 0))
    return sock


def call(sock, stream):
    """One whole Health/Check call; returns once its trailers are in."""
    sock.sendall(check_headers(stream) + frame(0x0, 0x1, stream, b"\x00" * 5))
    while True:
        header = read_exact(sock, 9)
        read_exact(sock, int.from_bytes(header[:3], "big"))
        on_stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        if on_stream == stream and header[3] == 0x1 and header[4] & 0x1:
            return


def hwm_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def cancelled_during_pause(pid, addr, tls, calls):
    """Pauses the server, sends `calls` calls each cancelled at once (what a
    client whose deadlines pass while the server is stopped sends), resumes
    it. Returns the peak RSS before and after, and whether the connection
    still answers a PING (no GOAWAY)."""
    sock = connect(addr, tls)
    peak = hwm_kib(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        burst = b"".join(
            check_headers(1 + 2 * i) + frame(0x3, 0, 1 + 2 * i, struct.pack(">I", 0x8))
            for i in range(calls)
        )
        sock.sendall(burst)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1)
    alive = False
    sock.settimeout(10)
    try:
        sock.sendall(frame(0x6, 0, 0, b"measure!"))
        while True:
            header = read_exact(sock, 9)
            read_exact(sock, int.from_bytes(header[:3], "big"))
            if header[3] == 0x7:  # GOAWAY
                break
            if header[3] == 0x6 and header[4] & 0x1:  # PING ACK
                alive = True
                break
    except (OSError, ConnectionError):
        pass
    sock.close()
    return peak, hwm_kib(pid), alive


def settle(pid, seconds=2.0):
    time.sleep(seconds)
    return rss_kib(pid)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--streams-connections", type=int, default=10)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--resets", type=int, default=0, help="also: calls cancelled during a pause")
    args = parser.parse_args()
    kind = "TLS" if args.tls else "plain text"

    before = settle(args.pid, 0.5)
    idle = [connect(args.addr, args.tls) for _ in range(args.connections)]
    after = settle(args.pid)
    per = (after - before) / args.connections
    print(f"{kind}: {args.connections} idle connections: RSS {before} -> {after} KiB, {per:.1f} KiB each")

    before = after
    for sock in idle:
        call(sock, 1)
    after = settle(args.pid)
    per = (after - before) / args.connections
    print(f"{kind}: the same after one call each: RSS {before} -> {after} KiB, {per:.1f} KiB more each")

    busy = idle[: args.streams_connections]
    before = after
    for sock in busy:
        for i in range(args.streams):
            sock.sendall(check_headers(3 + 2 * i))
    after = settle(args.pid)
    calls = args.streams_connections * args.streams
    per = (after - before) / calls
    print(f"{kind}: {calls} open calls on {len(busy)} connections: RSS {before} -> {after} KiB, {per:.2f} KiB each")
    for sock in idle:
        sock.close()

    if args.resets:
        before, after, alive = cancelled_during_pause(args.pid, args.addr, args.tls, args.resets)
        per = (after - before) / args.resets
        state = "connection kept" if alive else "connection closed (GOAWAY)"
        print(f"{kind}: {args.resets} calls cancelled during a pause: peak RSS {before} -> {after} KiB, {per:.2f} KiB each; {state}")


if __name__ == "__main__":
    main()
