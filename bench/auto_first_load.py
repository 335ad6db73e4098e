"""What auto's check of a first load costs: ``from_pretrained`` of a transformers model
(``--mib`` of float32 weights, default 512) in one process, three ways back to back:

- ``plain``: ``from_pretrained`` alone, no auto;
- ``auto``: under ``stageload.auto()``, as shipped: the reload recipe compares the first
  4 KiB of each tensor with the file (a library's ``from_pretrained``), as the diffusers
  adapter does;
- ``auto-whole``: the same with every byte compared, as auto does for a factory the user
  names (which may change a weight anywhere after reading it).

Each figure is the median of ``--runs`` (>= 7) rounds, the three interleaved in each round,
after one untimed round that reads the file into the page cache and touches the memory.
Results: ``bench/results/auto/first_load.md``.

    python bench/auto_first_load.py [--mib 512] [--runs 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "auto", "auto-whole")


def build(folder: Path, mib: int) -> int:
    """A BERT encoder of about ``mib`` MiB of float32 weights, saved with random weights."""
    import torch
    from transformers import BertConfig, BertModel

    hidden = 1024
    layers = max(1, round(mib * 2**20 / 4 / (12 * hidden * hidden)))
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        intermediate_size=4 * hidden,
        vocab_size=1024,
    )
    torch.manual_seed(0)
    model = BertModel(config)
    model.save_pretrained(folder)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load(mode: str, folder: Path) -> float:
    from transformers import BertModel

    import stageload.autostage as autostage

    start = time.perf_counter()
    if mode == "plain":
        model = BertModel.from_pretrained(folder)
    else:
        real = autostage._learn
        if mode == "auto-whole":  # the mechanism switched: every byte compared
            autostage._learn = lambda m, a, k, whole: real(m, a, k, whole=True)
        try:
            with autostage.auto(budget="100%"):
                model = BertModel.from_pretrained(folder)
        finally:
            autostage._learn = real
    seconds = time.perf_counter() - start
    assert model.embeddings.word_embeddings.weight.abs().sum() > 0  # loaded, not meta
    del model
    gc.collect()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="model size, MiB (default 512)")
    parser.add_argument("--runs", type=int, default=7, help="rounds, at least 7 (default 7)")
    args = parser.parse_args()
    if args.runs < 7:
        parser.error("--runs must be at least 7 (medians of 7 or more)")
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bert"
        nbytes = build(folder, args.mib)
        for mode in MODES:  # untimed: the file in the page cache, the memory touched
            load(mode, folder)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.runs):
            for mode in MODES:
                times[mode].append(load(mode, folder))
    med = {m: statistics.median(v) for m, v in times.items()}
    lines = [
        "# auto's check of a first load",
        "",
        f"`python bench/auto_first_load.py --mib {args.mib} --runs {args.runs}`, {date.today()},"
        f" {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}: BERT,"
        f" {nbytes / 2**20:.0f} MiB of float32 weights, `from_pretrained` from a warm page"
        f" cache, medians of {args.runs} rounds, the modes interleaved.",
        "",
        "| mode | what it measures | seconds | / plain |",
        "| --- | --- | --- | --- |",
    ]
    what = {
        "plain": "`from_pretrained` alone",
        "auto": "under auto: recipe checks the first 4 KiB of each tensor",
        "auto-whole": "under auto, every byte checked (a factory the user names)",
    }
    for mode in MODES:
        lines.append(
            f"| {mode} | {what[mode]} | {med[mode]:.3f} | {med[mode] / med['plain']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    out = ROOT / "bench" / "results" / "auto" / "first_load.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
