"""Peak footprint of ``stageload auto`` where transformers maps the weights (float32 on a CPU).

Three GPT-2 models of about 50 MB each (random weights from a fixed seed, saved with
``save_pretrained``), each called in turn for ``--laps`` laps (default 4), in three ways,
each in a fresh process:

- ``alone``: the script without stageload: transformers maps each checkpoint, and those
  pages are page cache, which the footprint does not count;
- ``auto``: the same script under ``stageload.auto`` with room for one model; a reload
  maps what the first load had mapped (``stageload.load.refill``'s ``Recipe.mapped``);
- ``auto-read``: the same, with that mapping turned off (the recipe's mapped set emptied):
  each reload reads the weights into the process's own memory, as before.

Figures, each the median of ``--runs`` (>= 7) runs, the modes interleaved: the peak
footprint (RssAnon + RssShmem, sampled every millisecond by a thread) and the peak of
RssFile beside it. Outputs are compared bit for bit with ``alone``'s in every run. The page
cache is warm throughout (the script writes the checkpoints, every run reads them).
Results: ``bench/results/auto/mapped.md``.

    python bench/auto_mapped.py [--laps 4] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("alone", "auto", "auto-read")
NAMES = ("g1", "g2", "g3")


def _sampler() -> tuple[threading.Event, dict[str, int]]:
    """A thread that records the highest footprint and RssFile every millisecond."""
    stop, peak = threading.Event(), {"footprint": 0, "file": 0}

    def sample() -> None:
        while not stop.is_set():
            fields = {}
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssShmem:", "RssFile:")):
                        key, value = line.split(":")
                        fields[key] = int(value.split()[0]) * 1024
            footprint = fields["RssAnon"] + fields["RssShmem"]
            peak["footprint"] = max(peak["footprint"], footprint)
            peak["file"] = max(peak["file"], fields["RssFile"])
            stop.wait(0.001)

    threading.Thread(target=sample, daemon=True).start()
    return stop, peak


def child(mode: str, folder: str, laps: int, out: str) -> None:
    import contextlib

    import torch
    from transformers import GPT2Model
    from transformers.utils import logging

    import stageload
    import stageload.autostage
    from stageload.load import refill

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if mode == "auto-read":
        learn = refill.learn

        def unmapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            recipe = learn(*args, **kwargs)
            if not isinstance(recipe, str):
                recipe.mapped = frozenset()
            return recipe

        stageload.autostage.learn = unmapped
    size = sum(f.stat().st_size for f in Path(folder, NAMES[0]).glob("*.safetensors"))
    scope = stageload.auto(budget=int(1.2 * size)) if mode != "alone" else contextlib.nullcontext()
    stop, peak = _sampler()
    ids = torch.arange(16).reshape(1, 16)
    outs = []
    with scope, torch.no_grad():
        models = [GPT2Model.from_pretrained(f"{folder}/{n}") for n in NAMES]
        for _ in range(laps):
            for model in models:
                outs.append(model(ids).last_hidden_state)
    stop.set()
    torch.save(torch.stack(outs), out)
    print(json.dumps(peak))


def run_child(mode: str, folder: str, laps: int, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", mode, folder, str(laps), out]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--laps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "auto" / "mapped.md"))
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (medians of 7 or more)")

    import torch
    from transformers import GPT2Config, GPT2Model
    from transformers.utils import logging

    sys.path.insert(0, str(ROOT / "bench"))
    from _touch import touch

    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        config = GPT2Config(n_embd=512, n_layer=3, n_head=8, vocab_size=8000)
        for name in NAMES:
            GPT2Model(config).save_pretrained(f"{folder}/{name}")
        touch(1 << 30)  # this VM backs a page at its first touch: once, for all
        peaks: dict[str, list[dict]] = {m: [] for m in MODES}
        equal = True
        for i in range(args.runs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                peaks[mode].append(run_child(mode, folder, args.laps, f"{folder}/{mode}.pt"))
            want = torch.load(f"{folder}/alone.pt")
            equal &= all(torch.equal(torch.load(f"{folder}/{m}.pt"), want) for m in MODES)
            print(f"run {i + 1}/{args.runs}", flush=True)
        size = sum(f.stat().st_size for f in Path(folder, NAMES[0]).glob("*.safetensors"))

    mib = 1 << 20
    foot = {m: statistics.median(p["footprint"] for p in peaks[m]) / mib for m in MODES}
    file = {m: statistics.median(p["file"] for p in peaks[m]) / mib for m in MODES}
    lines = [
        "# stageload auto where transformers maps the weights",
        "",
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, one torch thread. Three GPT-2 models of {size / mib:.0f} MiB "
        f"(float32, mapped by transformers), {args.laps} laps, auto's budget 1.2 x one "
        f"model, medians of {args.runs} runs, modes interleaved. The page cache is warm "
        "(the script writes the checkpoints, and each run reads them): a cold read costs "
        "time, not footprint. `python bench/auto_mapped.py`.",
        "",
        "| figure, MiB | alone | auto (reloads mapped) | auto (reloads read) |",
        "|---|---:|---:|---:|",
        f"| peak footprint (RssAnon + RssShmem) | {foot['alone']:.0f} | {foot['auto']:.0f} "
        f"({foot['auto'] / foot['alone']:.2f} x alone) | {foot['auto-read']:.0f} "
        f"({foot['auto-read'] / foot['alone']:.2f} x alone) |",
        f"| peak RssFile (mapped file pages) | {file['alone']:.0f} | {file['auto']:.0f} | "
        f"{file['auto-read']:.0f} |",
        "",
        f"Outputs bit for bit equal to alone's in every run: {'yes' if equal else 'NO'}.",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
