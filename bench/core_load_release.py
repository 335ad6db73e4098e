"""Benchmark the core: release speed, and StagedModels load throughput vs a raw disk read.

Prints, measured side by side in one run on one >= 1 GiB safetensors file:
- release: seconds per GiB to release the loaded model (StagedModels.enter);
- load: GiB/s of a StagedModels loader (meta skeleton + safetensors load_file + assign)
  divided by GiB/s of a raw sequential read of the same file, with a cold page cache
  (posix_fadvise DONTNEED on the file; also /proc/sys/vm/drop_caches when writable) and
  with a warm one.

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


def drop_cache(path: Path) -> str:
    """Evict the file from the page cache; return how."""
    os.sync()
    how = []
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        how.append("drop_caches")
    except OSError:
        pass
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            how.append("fadvise")
        finally:
            os.close(fd)
    return "+".join(how) or "none (warm only)"


def raw_read(path: Path) -> float:
    """Seconds to read the whole file sequentially into one buffer."""
    size = path.stat().st_size
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view)
            if not n:
                break
            done += n
    return time.perf_counter() - start


def staged_load_release(path: Path, total: int) -> tuple[float, float, int]:
    """(load seconds, release seconds, bytes) through StagedModels."""

    def load() -> nn.Module:
        with torch.device("meta"):
            model = make_model(total)
        model.load_state_dict(load_file(str(path)), assign=True)
        return model

    sink = ListSink()
    models = StagedModels({"m": load}, stages={"use": ["m"], "idle": []}, events=sink)
    models.enter("use")
    models["m"]
    models.enter("idle")
    (loaded,) = sink.kinds("load")
    (released,) = sink.kinds("release")
    return loaded.seconds or 0.0, released.seconds or 0.0, loaded.bytes or 0


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

        rows = {}
        how = ""
        for cache in ("cold", "warm"):
            raw, loads, releases = [], [], []
            for i in range(args.repeat):
                if cache == "cold":
                    how = drop_cache(path)
                else:
                    raw_read(path)  # make sure it is cached
                raw.append(raw_read(path))
                if cache == "cold":
                    drop_cache(path)
                load_s, release_s, nbytes = staged_load_release(path, total)
                loads.append(load_s)
                releases.append(release_s)
                print(
                    f"  {cache} #{i + 1}: raw read {gib / raw[-1]:.2f} GiB/s, "
                    f"staged load {nbytes / 2**30 / load_s:.2f} GiB/s, "
                    f"release {release_s / (nbytes / 2**30):.3f} s/GiB",
                    flush=True,
                )
            rows[cache] = (
                statistics.median(raw),
                statistics.median(loads),
                statistics.median(releases),
            )

    lines = [
        f"# Core: load throughput and release speed ({date.today().isoformat()})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}; torch {torch.__version__}, 1 torch thread. Model: "
        f"{gib:.2f} GiB safetensors (512 x 64 KiB + 16 MiB tensors), median of {args.repeat} runs. "
        f"Cold cache via {how}.",
        "",
        "| page cache | raw read GiB/s | staged load GiB/s | load / raw | release s/GiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for cache, (raw_s, load_s, rel_s) in rows.items():
        lines.append(
            f"| {cache} | {gib / raw_s:.2f} | {gib / load_s:.2f} | {raw_s / load_s:.2f} | "
            f"{rel_s / gib:.3f} |"
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
