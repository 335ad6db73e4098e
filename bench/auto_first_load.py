"""What auto adds to a model's first load: ``from_pretrained`` of a transformers model
(``--mib`` of float32 weights, default 512) and its first use (one weight read), in one
process, four ways back to back:

- ``plain``: no auto;
- ``auto``: under ``stageload.auto()``, as shipped: ``from_pretrained`` builds the model
  on ``meta`` from its config (a stand-in) and its first use reads it, then checks the
  first 4 KiB of each tensor with the file for its reload recipe (a library's
  ``from_pretrained``, as the diffusers adapter checks);
- ``auto-at-call``: the stand-in switched off: read at the ``from_pretrained`` call, as
  auto did before it stood in, with the same 4 KiB check;
- ``auto-whole``: read at the call, every byte compared, as auto does for a factory the
  user names (which may change a weight anywhere after reading it).

Each figure is the median of ``--runs`` (>= 7) rounds, the four interleaved in each round,
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
MODES = ("plain", "auto", "auto-at-call", "auto-whole")


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
    """Seconds for ``from_pretrained`` and the model's first use, in ``mode``."""
    from transformers import BertModel

    import stageload.autostage as autostage

    def first_use(model: BertModel) -> None:
        assert model.embeddings.word_embeddings.weight.abs().sum() > 0  # read, not meta

    start = time.perf_counter()
    if mode == "plain":
        model = BertModel.from_pretrained(folder)
        first_use(model)
    else:
        learn, stand_in = autostage._learn, autostage._stand_in
        if mode != "auto":  # the stand-in switched off: read at the call
            autostage._stand_in = lambda cls, args, kwargs, rng: None
        if mode == "auto-whole":  # and every byte compared
            autostage._learn = lambda m, a, k, whole: learn(m, a, k, whole=True)
        try:
            with autostage.auto(budget="100%"):
                model = BertModel.from_pretrained(folder)
                first_use(model)
        finally:
            autostage._learn, autostage._stand_in = learn, stand_in
    seconds = time.perf_counter() - start
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
        "# What auto adds to a first load",
        "",
        f"`python bench/auto_first_load.py --mib {args.mib} --runs {args.runs}`, {date.today()},"
        f" {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}: BERT,"
        f" {nbytes / 2**20:.0f} MiB of float32 weights, `from_pretrained` and the first use"
        f" (one weight read) from a warm page cache, medians of {args.runs} rounds, the"
        f" modes interleaved.",
        "",
        "| mode | what it measures | seconds | / plain |",
        "| --- | --- | --- | --- |",
    ]
    what = {
        "plain": "no auto",
        "auto": "under auto: built on meta, read at the first use, first 4 KiB checked",
        "auto-at-call": "under auto, read at the call (no stand-in), first 4 KiB checked",
        "auto-whole": "under auto, read at the call, every byte checked (a named factory)",
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
