"""What streaming looks like in a trace: a 512 MiB stack of 16 blocks, streamed under the
memory meter (10 ms samples), then eagerly loaded for comparison, and ``stageload plot``'s
figure of both. The streamed footprint is a sawtooth (a block read, computed, freed),
not the one step of a whole load.

    python bench/stream_plot.py      # writes bench/results/stream/trace-*.jsonl and plot.png
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from stageload import MemoryMeter, from_safetensors, return_memory_to_os, streamed  # noqa: E402
from stageload.report.plot import plot_traces  # noqa: E402
from stageload.testing.blocks import BlockStack, save_block_stack  # noqa: E402

OUT = ROOT / "bench" / "results" / "stream"


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "stack.safetensors"
        config = save_block_stack(file, width=2048, depth=16)
        return_memory_to_os()  # the stack built to save it: gone before the meters start
        x = torch.randn(64, config["features"], generator=torch.Generator().manual_seed(0))
        outputs = {}
        for mode in ("streamed", "eager"):
            trace = OUT / f"trace-{mode}.jsonl"
            with MemoryMeter(trace, interval=0.01, meta={"label": mode}) as meter, torch.no_grad():
                if mode == "streamed":
                    model = streamed(lambda: BlockStack(**config), file, name="stack", events=meter)
                else:
                    model = from_safetensors(lambda: BlockStack(**config), file)()
                meter.mark("forward")
                outputs[mode] = model(x)
                del model
        same = torch.equal(outputs["streamed"], outputs["eager"])
        print(f"outputs identical: {same}")
        plot_traces([OUT / "trace-eager.jsonl", OUT / "trace-streamed.jsonl"], OUT / "plot.png")
        print(f"plot: {OUT / 'plot.png'}")


if __name__ == "__main__":
    main()
