"""How fast stageload.load_weights fills a model, against a raw sequential read of the same bytes.

Every case is measured cold (the file's pages dropped with posix_fadvise(DONTNEED); the
share still resident afterwards, from mincore, is reported) and warm, each right after a
raw sequential read of the same file in the same state, so the ratio compares like with
like on a machine whose disk and CPUs other processes share. Medians over --runs.

Cases (1 GiB float16 checkpoint of Linear/LayerNorm blocks, unless --gb says otherwise):
  raw                 one stream, os.readv into one reused 16 MiB buffer (the yardstick)
  lw                  load_weights, fp16 -> fp16, CPU, default threads, huge pages advised
  lw-plain            the same, destinations from plain torch.empty (no madvise)
  lw-mmap             the same, destinations in an own mmap per tensor, huge pages advised
  lw-t1, lw-t2, lw-t8 thread counts
  (removed, issue 37: lw-old, lw-ranges, lw-ranges-t2, lw-seq, lw-ahead, lw-c64,
   lw-willneed, lw-willneed128, lw-old-t2 and the reader knobs they set, LAYOUT,
   SEQUENTIAL, AHEAD: none beat the kept reader; their tables stay in
   bench/results/load/cold-*.md, summed up in docs/load.md)
  lw-inplace          load_weights into a module materialised and touched beforehand: the
                      reads without the destination's page faults
  hand                a hand-written loader: per-tensor torch.empty, huge pages advised,
                      4 threads of 16 MiB preadv from one descriptor (the warm yardstick)
  lw-bf16             load_weights, fp16 -> bf16
  convert             in memory, fp16 tensors -> fresh bf16 ones (copy_, torch 2 threads)
  fresh, fresh-plain  no file: fill fresh memory once (huge pages advised, or not)
  load_file+copy      safetensors.torch.load_file, then clone() every tensor (fp16)
  load_file+bf16      load_file, then .to(bfloat16)
  diffusers-*         with --diffusers FOLDER: a transformer component, from_pretrained vs
                      the staged adapter's load (see bench/results/load/README)

Footprint: RssAnon + RssShmem, sampled every 2 ms by a thread (the reads release the GIL),
peak minus the value before the load minus the loaded weights.

Memory is touched once before any timing (bench/_touch.py): on this VM the first touch of
a guest page costs a host fault, which would slow whichever case ran first.

    python bench/load.py                      # ~10 min on 2 busy cores
    python bench/load.py --runs 3 --cases raw lw lw-bf16
    python bench/load.py --runs 7 --cases lw --vs hand --tag warm-vs-hand   # warm only
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _touch import touch  # noqa: E402

from stageload import load_weights, release  # noqa: E402
from stageload.load import weights as load_mod  # noqa: E402

GIB = 1 << 30
HUGE = 2 << 20


# -- the checkpoint ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)
        self.norm = nn.LayerNorm(h)


def build(gb: float, dtype: torch.dtype = torch.float16) -> nn.Module:
    h = 2048
    layers = max(1, round(gb * GIB / (8 * h * h * 2)))
    with torch.device("meta"):
        return nn.Sequential(*[Block(h) for _ in range(layers)]).to(dtype)


def make_checkpoint(path: Path, gb: float) -> Path:
    if path.exists():
        return path
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {
        k: torch.randn(v.shape, generator=g, dtype=torch.float32).to(torch.float16)
        for k, v in build(gb).state_dict().items()
    }
    save_file(state, str(path))
    return path


# -- page cache -------------------------------------------------------------------------------
def drop_cache(files: list[Path]) -> float:
    """posix_fadvise(DONTNEED) each file; returns the share of its pages still resident."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident(files)


def resident(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore on a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = os.sysconf("SC_PAGE_SIZE")
    total = inside = 0
    for f in files:
        size = f.stat().st_size
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(f, os.O_RDONLY)
        try:
            base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            libc.mincore(ctypes.c_void_p(base), size, vec)
            libc.munmap(ctypes.c_void_p(base), size)
        finally:
            os.close(fd)
        inside += sum(v & 1 for v in bytes(vec))
        total += pages
    return inside / max(1, total)


def warm(files: list[Path]) -> None:
    for f in files:
        raw_read(f)


def raw_read(path: Path) -> int:
    buf = bytearray(16 << 20)
    fd = os.open(path, os.O_RDONLY)
    n = 0
    try:
        while True:
            got = os.readv(fd, [buf])
            if got == 0:
                return n
            n += got
    finally:
        os.close(fd)


# -- footprint --------------------------------------------------------------------------------
def footprint() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


class Peak:
    def __init__(self) -> None:
        self.peak = self.start = footprint()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, footprint())

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, footprint())


# -- allocation variants ----------------------------------------------------------------------
def mmap_destination(
    old: torch.Tensor, dtype: torch.dtype, device: torch.device, misalign: int = 0
) -> torch.Tensor:
    """One anonymous mapping per tensor, 2 MiB aligned, huge pages advised."""
    n = old.numel() * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, n + HUGE)
    probe = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(probe)
    del probe
    off = (-addr) % HUGE
    mm.madvise(mmap.MADV_HUGEPAGE, off, (n // HUGE) * HUGE or mmap.PAGESIZE)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off)
    return flat.view(dtype).view(old.shape)


# -- cases ------------------------------------------------------------------------------------
def case_load_weights(ckpt: Path, gb: float, **kw: Any) -> Callable[[], tuple[int, Any]]:
    alloc = kw.pop("alloc", "thp")
    chunk = kw.pop("chunk", load_mod.CHUNK)

    def run() -> tuple[int, Any]:
        module = build(gb)
        saved = (load_mod._ALLOC, load_mod._destination, load_mod.CHUNK)
        load_mod._ALLOC = "plain" if alloc == "plain" else "thp"
        load_mod.CHUNK = chunk
        if alloc == "mmap":
            load_mod._destination = mmap_destination
        try:
            n = load_weights(module, ckpt, **kw)
        finally:
            load_mod._ALLOC, load_mod._destination, load_mod.CHUNK = saved
        return n, module

    return run


def inplace_case(ckpt: Path, gb: float) -> Callable[[], tuple[int, Any]]:
    """load_weights into a module already materialised and touched (outside the timing):
    the same reads with no page faults on the destination, so what is left is the I/O."""
    module = build(gb).to_empty(device="cpu")
    for p in module.parameters():
        p.data.zero_()  # every page touched once, before any timing

    def run() -> tuple[int, Any]:
        return load_weights(module, ckpt), None  # kept (and reused) until the case ends

    return run


def hand_case(ckpt: Path, threads: int = 4) -> Callable[[], tuple[int, Any]]:
    """The yardstick of warm loads: what one would write by hand for the fastest read into
    fresh tensors (header parsed here, per-tensor torch.empty, huge pages advised, 16 MiB
    preadv chunks from a pool of ``threads`` on one descriptor)."""
    from concurrent.futures import ThreadPoolExecutor

    from stageload.hooks.release import advise_huge_pages
    from stageload.load.reader import memory

    with open(ckpt, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    base = 8 + size
    spans = [(k, v["data_offsets"]) for k, v in header.items() if k != "__metadata__"]
    chunk = 16 << 20

    def run() -> tuple[int, Any]:
        out: dict[str, torch.Tensor] = {}
        jobs = []
        for name, (a, b) in spans:
            t = torch.empty(b - a, dtype=torch.uint8)
            advise_huge_pages(t.data_ptr(), t.nbytes)
            out[name] = t
            jobs += [
                (t, at, base + a + at, min(chunk, b - a - at)) for at in range(0, b - a, chunk)
            ]
        fd = os.open(ckpt, os.O_RDONLY)

        def read(t: torch.Tensor, at: int, offset: int, n: int) -> None:
            view, done = memory(t, at, n), 0
            while done < n:
                done += os.preadv(fd, [view[done:]], offset + done)

        try:
            with ThreadPoolExecutor(threads) as pool:
                for f in [pool.submit(read, *j) for j in jobs]:
                    f.result()
        finally:
            os.close(fd)
        return sum(t.nbytes for t in out.values()), out

    return run


def case_load_file(ckpt: Path, dtype: torch.dtype | None) -> Callable[[], tuple[int, Any]]:
    from safetensors.torch import load_file

    def run() -> tuple[int, Any]:
        state = load_file(str(ckpt))
        out = {k: (v.to(dtype) if dtype else v.clone()) for k, v in state.items()}
        del state
        return sum(v.nbytes for v in out.values()), out

    return run


def free(obj: Any) -> None:
    if isinstance(obj, _Evict):
        obj.free()
    elif isinstance(obj, nn.Module):
        release(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                v.untyped_storage().resize_(0)
        obj.clear()
    from stageload import return_memory_to_os

    return_memory_to_os(collect=False)


def measure(fn: Callable[[], tuple[int, Any]]) -> dict[str, float]:
    base = footprint()
    with Peak() as peak:
        start = time.perf_counter()
        nbytes, obj = fn()
        seconds = time.perf_counter() - start
    held = footprint() - base
    free(obj)
    del obj
    returned = held - (footprint() - base)
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "gbps": nbytes / seconds / 1e9,
        "over_weights": peak.peak - base - nbytes,
        "peak": peak.peak - base,
        "anon_after_load": held,
        "returned_by_release": returned,
    }


def measure_raw(files: list[Path]) -> dict[str, float]:
    start = time.perf_counter()
    n = sum(raw_read(f) for f in files)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": n, "gbps": n / seconds / 1e9}


def fresh_case(gb: float, advise: bool) -> Callable[[], tuple[int, Any]]:
    """No file at all: allocate fresh memory and write every byte once (torch, 2 threads).
    The ceiling for any loader that leaves the weights in fresh process memory."""
    from stageload.hooks.release import advise_huge_pages

    def run() -> tuple[int, Any]:
        t = torch.empty(int(gb * GIB), dtype=torch.uint8)
        if advise:
            advise_huge_pages(t.data_ptr(), t.nbytes)
        t.fill_(1)
        return t.nbytes, {"t": t}

    return run


def convert_case(ckpt: Path) -> Callable[[], tuple[int, Any]]:
    from safetensors.torch import load_file

    src = {k: v.clone() for k, v in load_file(str(ckpt)).items()}  # in memory, fp16

    def run() -> tuple[int, Any]:
        out = {k: torch.empty_like(v, dtype=torch.bfloat16).copy_(v) for k, v in src.items()}
        return sum(v.nbytes for v in out.values()), out

    return run


def diffusers_cases(folder: Path) -> dict[str, Any]:
    """A Qwen-Image transformer (fp16 checkpoint, torch_dtype fp16): from_pretrained, and the
    staged adapter's reload (its first load, the from_pretrained reference, done before)."""
    import diffusers

    import stageload.diffusers.qwen_processor  # noqa: F401  (the fixture's processor class)
    from stageload.diffusers import staged_pipeline
    from stageload.diffusers._plan import model_components

    files = sorted((folder / "transformer").glob("*.safetensors"))
    cls = model_components(folder)["transformer"]
    state: dict[str, Any] = {}

    def from_pretrained() -> Callable[[], tuple[int, Any]]:
        def run() -> tuple[int, Any]:
            model = cls.from_pretrained(folder / "transformer", torch_dtype=torch.float16)
            return sum(t.nbytes for t in model.state_dict().values()), model

        return run

    def adapter() -> Callable[[], tuple[int, Any]]:
        if "pipe" not in state:
            pipe = staged_pipeline(
                diffusers.QwenImage21Pipeline, folder, torch_dtype=torch.float16, keep=()
            )
            pipe.stageload.models["transformer"]  # the reference load, then learned
            pipe.stageload.models.evict("transformer")
            state["pipe"] = pipe
        models = state["pipe"].stageload.models

        def run() -> tuple[int, Any]:
            model = models["transformer"]
            assert "_stageload_recipe" in model.__dict__, "the adapter did not learn"
            return sum(t.nbytes for t in model.state_dict().values()), _Evict(models)

        return run

    return {
        "diffusers-from_pretrained": (from_pretrained, files, True),
        "diffusers-adapter": (adapter, files, True),
    }


class _Evict:
    def __init__(self, models: Any) -> None:
        self.models = models

    def free(self) -> None:
        self.models.evict("transformer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/stageload-bench-load"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/load")
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--tag", default="results", help="names the output files")
    parser.add_argument("--diffusers", type=Path, default=None, help="a Qwen-Image fixture folder")
    parser.add_argument("--tables-only", action="store_true", help="redo the tables from JSON")
    parser.add_argument(
        "--vs",
        choices=("raw", "hand"),
        default="raw",
        help="the yardstick run back to back with each case: the raw read, or (warm only) "
        "the hand-written parallel loader",
    )
    args = parser.parse_args(argv)
    if args.tables_only:
        write(args.out, json.loads((args.out / f"{args.tag}.json").read_text()), args)
        return 0
    torch.set_num_threads(2)
    args.dir.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(args.dir / f"blocks-{args.gb:g}g-fp16.safetensors", args.gb)
    files = [ckpt]
    # The host backs a guest page at its first touch: touch the working size (weights and
    # a yardstick's copy) once, so the first case timed pays it no more than the others.
    print(f"touched {2 * args.gb:g} GiB in {touch(int(2 * args.gb * GIB)):.1f} s", flush=True)
    bf16 = torch.bfloat16
    cases: dict[str, tuple[Callable[[], Callable[[], tuple[int, Any]]], list[Path], bool]] = {
        "lw": (lambda: case_load_weights(ckpt, args.gb), files, True),
        "lw-plain": (lambda: case_load_weights(ckpt, args.gb, alloc="plain"), files, True),
        "lw-mmap": (lambda: case_load_weights(ckpt, args.gb, alloc="mmap"), files, True),
        "lw-t1": (lambda: case_load_weights(ckpt, args.gb, threads=1), files, True),
        "lw-t2": (lambda: case_load_weights(ckpt, args.gb, threads=2), files, True),
        "lw-t8": (lambda: case_load_weights(ckpt, args.gb, threads=8), files, True),
        "hand": (lambda: hand_case(ckpt), files, True),
        "lw-inplace": (lambda: inplace_case(ckpt, args.gb), files, True),
        "lw-bf16": (lambda: case_load_weights(ckpt, args.gb, dtype=bf16), files, True),
        "convert": (lambda: convert_case(ckpt), files, False),
        "fresh": (lambda: fresh_case(args.gb, True), files, False),
        "fresh-plain": (lambda: fresh_case(args.gb, False), files, False),
        "load_file+copy": (lambda: case_load_file(ckpt, None), files, True),
        "load_file+bf16": (lambda: case_load_file(ckpt, bf16), files, True),
    }
    if args.diffusers is not None:
        cases.update(diffusers_cases(args.diffusers))
    names = args.cases or list(cases)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for run in range(args.runs):
        for name in names:
            make, case_files, disk = cases[name]
            fn = make()
            caches = ("cold", "warm") if disk else ("memory",)
            if args.vs == "hand":  # the hand-written loader is a warm yardstick
                caches, hand = ("warm",), hand_case(ckpt)
            for cache in caches:
                key = f"{name}|{cache}"
                row = results.setdefault(key, {"raw": [], "case": []})
                if cache == "cold":
                    left = drop_cache(case_files)
                    raw = measure_raw(case_files) | {"resident_before": left}
                    left = drop_cache(case_files)
                    got = measure(fn) | {"resident_before": left}
                elif cache == "warm":
                    warm(case_files)
                    raw = measure(hand) if args.vs == "hand" else measure_raw(case_files)
                    got = measure(fn)
                else:
                    warm(case_files)
                    raw = measure_raw(case_files)
                    got = measure(fn)
                got["ratio"] = got["gbps"] / raw["gbps"]
                row["raw"].append(raw)
                row["case"].append(got)
                print(
                    f"run {run} {name:16s} {cache:6s} {got['gbps']:.2f} GB/s "
                    f"(raw {raw['gbps']:.2f}) x{got['ratio']:.2f} "
                    f"over {got['over_weights'] / 2**20:.0f} MiB",
                    flush=True,
                )
            del fn
    write(args.out, results, args)
    return 0


def write(out: Path, results: dict[str, Any], args: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    med = statistics.median
    yardstick = (
        "the hand-written parallel loader (bench/load.py hand_case)"
        if getattr(args, "vs", "raw") == "hand"
        else "a raw sequential read of the same file"
    )
    lines = [
        f"# load_weights against a raw read ({args.gb:g} GiB float16 checkpoint, "
        f"{max(len(r['case']) for r in results.values())} runs, medians)",
        "",
        f"Yardstick run back to back before each case: "
        f"{yardstick}. "
        "Memory touched once before timing (bench/_touch.py).",
        "",
        f"Machine: {os.cpu_count()} CPUs shared with other agents' jobs (noisy: medians), "
        f"torch {torch.__version__}, THP "
        f"{Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}.",
        "Cold: posix_fadvise(DONTNEED) before each read (drop_caches is not permitted "
        "here); 'left' is the share of the file still cached afterwards (mincore).",
        "",
        "| case | cache | GB/s | yardstick GB/s | ratio to yardstick (median of pairs) | "
        "in process memory after the load | peak above the weights | released | left |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, row in results.items():
        name, cache = key.split("|")
        case, raw = row["case"], row["raw"]
        left = [c.get("resident_before") for c in case if c.get("resident_before") is not None]
        released = med(c["returned_by_release"] / max(1, c["anon_after_load"]) for c in case)
        lines.append(
            f"| {name} | {cache} | {med(c['gbps'] for c in case):.2f} | "
            f"{med(r['gbps'] for r in raw):.2f} | {med(c['ratio'] for c in case):.2f} | "
            f"{med(c['anon_after_load'] / c['bytes'] for c in case):.0%} of the weights | "
            f"{med(c['over_weights'] for c in case) / 2**20:.0f} MiB | "
            f"{released:.0%} | "
            f"{(max(left) if left else 0):.0%} |"
        )
    (out / f"{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
