"""Benchmark the core: a StagedModels load that puts every byte in process memory, against a
raw read of the same file; and release, on the path that frees anonymous memory in place.

Measured side by side in one run, on one safetensors file (1 GiB by default), median of
``--repeat`` runs each, with a cold page cache (posix_fadvise DONTNEED on the file, and
/proc/sys/vm/drop_caches when writable) and a warm one:

- raw read: ``readinto`` of the whole file into a fresh buffer of its size, so every byte
  lands in new anonymous memory (the floor for any load: disk or page cache, plus the page
  faults of a fresh destination);
- load: a StagedModels loader as ``from_pretrained`` does it: the structure on ``meta``,
  ``to_empty(device="cpu")``, then ``load_state_dict(safetensors load_file(...))``, which
  copies every tensor into the model's own anonymous storage. RssAnon is checked to grow by
  the file's size, so this is not a lazy mmap (``assign=True`` would keep file pages, copy
  nothing, and measure only the setting up of a mapping);
- release: ``StagedModels.enter`` of a stage without the model: ``release()`` empties the
  anonymous storage in place (``resize_(0)``) and trims malloc's heap; RssAnon is checked
  to come back.

Usage: python bench/core_load_release.py [--size-gib 1] [--repeat 3] [--out bench/results/core]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from stageload import ListSink, StagedModels

CHUNK = 16 * 2**20


def make_model(total: int) -> nn.Module:
    """Mostly 16 MiB matrices plus 512 small 64 KiB tensors, like a real checkpoint."""
    model = nn.Module()
    model.small = nn.ParameterList(nn.Parameter(torch.empty(16 * 1024)) for _ in range(512))
    n_large = max(1, (total - 512 * 64 * 1024) // CHUNK)
    model.large = nn.ParameterList(nn.Parameter(torch.empty(CHUNK // 4)) for _ in range(n_large))
    return model


def rss_anon() -> int:
    """Anonymous resident memory of this process (Linux), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def drop_cache(path: Path) -> str:
    """Evict the file from the page cache; return how."""
    os.sync()
    how = []
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        how.append("drop_caches")
    except OSError:
        pass
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        how.append("posix_fadvise(DONTNEED)")
    finally:
        os.close(fd)
    return " + ".join(how)


def raw_read(path: Path) -> float:
    """Seconds to read the whole file into a fresh buffer of its size."""
    size = path.stat().st_size
    start = time.perf_counter()
    buf = torch.empty(size, dtype=torch.uint8)  # fresh anonymous memory, as a load gets
    view = memoryview(buf.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view[done : done + CHUNK])
            if not n:
                break
            done += n
    seconds = time.perf_counter() - start
    if done != size:
        raise RuntimeError(f"read {done} of {size} bytes")
    del view, buf
    return seconds


def plain_free(size: int) -> float:
    """Seconds to free a plain tensor of ``size`` touched bytes: the kernel's share of any
    release (unmapping the pages), measured beside it."""
    buf = torch.ones(size // 4)
    start = time.perf_counter()
    del buf
    return time.perf_counter() - start


def load_release(path: Path, total: int) -> dict[str, float]:
    """One load and one release through StagedModels, with RssAnon around each."""

    def load() -> nn.Module:
        with torch.device("meta"):
            model = make_model(total)
        model.to_empty(device="cpu")
        model.load_state_dict(load_file(str(path)))  # copies into the model's own storage
        return model

    sink = ListSink()
    models = StagedModels({"m": load}, stages={"use": ["m"], "idle": []}, events=sink)
    before = rss_anon()
    models.enter("use")
    models["m"]
    loaded_rss = rss_anon()
    models.enter("idle")
    released_rss = rss_anon()
    (loaded,) = sink.kinds("load")
    (released,) = sink.kinds("release")
    return {
        "load_s": loaded.seconds or 0.0,
        "release_s": released.seconds or 0.0,
        "bytes": float(loaded.bytes or 0),
        "rss_added": float(loaded_rss - before),
        "rss_returned": float(loaded_rss - released_rss),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/core"))
    parser.add_argument("--dir", type=Path, default=None, help="where to write the model file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one copy thread, as a loader runs; keeps runs comparable
    total = int(args.size_gib * 2**30)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        print(f"writing a {args.size_gib:g} GiB safetensors model to {path} ...", flush=True)
        model = make_model(total)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        save_file(model.state_dict(), str(path))
        del model
        size = path.stat().st_size
        gib = size / 2**30

        rows: dict[str, dict[str, float]] = {}
        how = ""
        for cache in ("cold", "warm"):
            runs: list[dict[str, float]] = []
            for i in range(args.repeat):
                if cache == "cold":
                    how = drop_cache(path)
                else:
                    raw_read(path)  # make sure it is cached
                raw = raw_read(path)
                if cache == "cold":
                    drop_cache(path)
                run = load_release(path, total)
                run["raw_s"] = raw
                run["free_s"] = plain_free(size)
                if run["rss_added"] < 0.95 * size:
                    raise SystemExit(
                        f"the load added only {run['rss_added'] / 2**20:.0f} MiB of anonymous "
                        f"memory for a {size / 2**20:.0f} MiB file: not a load into memory"
                    )
                runs.append(run)
                print(
                    f"  {cache} #{i + 1}: raw read {gib / raw:.2f} GiB/s, "
                    f"load {gib / run['load_s']:.2f} GiB/s "
                    f"(+{run['rss_added'] / 2**30:.2f} GiB RssAnon), "
                    f"release {run['release_s'] / gib:.3f} s/GiB "
                    f"(plain free {run['free_s'] / gib:.3f}) "
                    f"(-{run['rss_returned'] / 2**30:.2f} GiB RssAnon)",
                    flush=True,
                )
            rows[cache] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    load_s = os.getloadavg()[0]
    lines = [
        f"# Core: load into memory vs raw read, and release ({date.today().isoformat()})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}; torch {torch.__version__}, 1 torch thread. Model: "
        f"{gib:.2f} GiB safetensors (512 x 64 KiB + 16 MiB float32 tensors), median of "
        f"{args.repeat} runs each. Cold cache via {how}. Load average at the end: "
        f"{load_s:.1f} (other jobs shared the machine: figures are noisy).",
        "",
        "- raw read: the whole file `readinto` a fresh buffer of its size (every byte into "
        "new anonymous memory).",
        "- load: StagedModels loader: `meta` structure, `to_empty`, `load_state_dict(load_file)`"
        ", which copies every byte into the model's own anonymous memory (RssAnon grew by the "
        "column below).",
        "- release: `StagedModels.enter` of a stage without the model: storage emptied in place "
        "and malloc trimmed (RssAnon came back by the column below). Beside it, freeing one "
        "plain tensor of the same size (`del`): the kernel's unmapping, which bounds release.",
        "",
        "| page cache | raw read GiB/s | load GiB/s | load / raw read | RssAnon added by load "
        "| release s/GiB | plain free s/GiB | RssAnon returned |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cache, r in rows.items():
        lines.append(
            f"| {cache} | {gib / r['raw_s']:.2f} | {gib / r['load_s']:.2f} | "
            f"{r['raw_s'] / r['load_s']:.2f} | {r['rss_added'] / 2**30:.2f} GiB | "
            f"{r['release_s'] / gib:.3f} | {r['free_s'] / gib:.3f} | "
            f"{r['rss_returned'] / 2**30:.2f} GiB |"
        )
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load-release.md").write_text(table)
    print(f"wrote {args.out / 'load-release.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
