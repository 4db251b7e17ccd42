#!/usr/bin/env python3
"""A process's CPU by the layer it ran in: our code, or the libraries and the kernel under it.

Reads `perf script -F ip,sym,dso` of a `perf record --call-graph dwarf` of one process
(the server or the load generator) and puts each sample in one layer:

  kernel:     the sample was in the kernel (system calls, scheduling, the loopback);
  allocator:  in malloc, free or their helpers, whoever called them;
  otherwise the innermost frame of a known crate decides: gRPC/HTTP/2 (h2, hyper,
  http, tonic, tower, axum), prost (and the generated messages), sqlx, tokio and
  futures, tracing, metrics, the load generator's own code (idempotency_bench and
  its histogram), or ours (idempotency_*: the server, the client library);
  other:      no known frame (libc, core, std alone).

Inlined frames are skipped: a sample counts for the function it was compiled into.
Dropping a value (`core::ptr::drop_in_place<T>`) counts for the crate of T; other
generic frames of core, alloc and std (an `Arc`'s drop, say) count for their caller.
The split says how much of a process's CPU its own code could give back at most
(docs/performance.md, "Sixteen callers in lockstep").

Usage: python3 bench/cpu_by_layer.py SCRIPT_FILE
"""

import collections
import re
import sys

LAYERS = [
    ("gRPC/HTTP/2 (h2, hyper, http, tonic, tower, axum)",
     r"(h2|hyper|hyper_util|http|httparse|tonic|tonic_prost|tower|axum|axum_core)::"),
    ("prost", r"(prost|idempotency_proto)::"),
    ("sqlx", r"sqlx_\w+::"),
    ("tokio, futures", r"(tokio|tokio_util|futures_\w+)::"),
    ("tracing", r"(tracing|tracing_core|tracing_subscriber|sharded_slab)::"),
    ("metrics", r"(metrics|metrics_util|metrics_exporter_prometheus)::"),
    ("the load generator's own (idempotency_bench, hdrhistogram)", r"(idempotency_bench|hdrhistogram)::"),
    ("ours", r"idempotency_\w+::"),
]
# A frame belongs to a crate when its path starts with it, or a trait impl's
# type does (`<h2::proto::... as ...>`).
LAYERS = [(name, re.compile(r"^<?" + crate)) for name, crate in LAYERS]
ALLOCATOR = re.compile(
    r"^(__GI_)?(__libc_)?(malloc|free|cfree|calloc|realloc|memalign|posix_memalign|"
    r"aligned_alloc)\b|^(__posix_memalign|_int_\w+|sysmalloc|tcache_\w+|unlink_chunk|"
    r"malloc_consolidate|_mid_memalign)"
)
# `ip symbol (dso)`; an inlined frame's "dso" reads `inlined`.
FRAME = re.compile(r"\s*[0-9a-f]+ (.*) \(([^)]*)\)$")
# Dropping a value counts for the crate of its type.
DROP = re.compile(r"^core::ptr::drop_in_place<&?(mut )?")


def layer(stack):
    """The layer of one sample, its frames innermost first as (symbol, dso)."""
    symbol, dso = stack[0]
    if "kernel.kallsyms" in dso:
        return "kernel"
    if ALLOCATOR.match(symbol):
        return "allocator"
    for symbol, dso in stack:
        if dso == "inlined":
            continue
        symbol = DROP.sub("", symbol)
        for name, crate in LAYERS:
            if crate.match(symbol):
                return name
    return "other (libc, core, std)"


def samples(lines):
    """Each sample's stack."""
    stack = []
    for line in lines:
        match = FRAME.match(line.rstrip("\n"))
        if match:
            stack.append((match[1], match[2]))
        elif not line.strip() and stack:
            yield stack
            stack = []
    if stack:
        yield stack


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as script:
        layers = collections.Counter(layer(stack) for stack in samples(script))
    total = sum(layers.values())
    if not total:
        sys.exit("no samples with call chains: record with --call-graph dwarf, "
                 "write the script with -F ip,sym,dso")
    for name, count in layers.most_common():
        print(f"{100 * count / total:5.1f} %  {name}")
    print(f"{total} samples")


if __name__ == "__main__":
    main()
