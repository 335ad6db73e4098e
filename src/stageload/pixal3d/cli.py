"""``stageload-pixal3d IMAGE -o OUT.glb``: run the Pixal3D-mac port with staged loading.

Options this command does not know are passed to the port's own ``parse_args``
(``--device``, ``--pipeline-type``, ``--steps``, ``--texture-size``, ...). Light to import:
torch and the port load only once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cli.args import interval, unusable_folder, unwritable_file
from .plan import LOADS, MODEL_NAMES, STAGES, check_stream

EXIT_OK = 0
#: The run failed: a model could not load, or the port raised.
EXIT_FAILED = 1
#: Bad usage: arguments, a missing or mismatched port, an unsupported pipeline.
EXIT_USAGE = 2

PROG = "stageload-pixal3d"

DESCRIPTION = """\
Run the Pixal3D-mac image-to-3D port with staged loading: each model is loaded when its
stage first needs it and released when the next stage doesn't, the four feature
extractors share one DINOv3 backbone, and the port's low-VRAM mode is off. The port's
run() executes unchanged, with the same seed and noise as its own loading.

The port is imported from your checkout: --port DIR or $STAGELOAD_PIXAL3D_PORT. Any
option not listed here goes to the port (e.g. --device, --pipeline-type, --steps,
--texture-size, --fov). Only --pipeline-type 1024_cascade has a stage plan.

--stream NAME loads a model block by block instead of whole: its parts outside its block
list when its stage begins, each block at its call, freed right after (for a model larger
than memory; same latents, slower). Flow models have block lists; a model without one
is refused before the run.

stages: setup, preprocess, camera, structure, shape_512, shape_1024, texture, decode, export

examples:
  stageload-pixal3d photo.png -o photo.glb --port ~/src/Pixal3D-mac
  stageload-pixal3d a.png b.png c.png -o out/     # stage-major: each model loaded once
  stageload-pixal3d photo.png -o photo.glb --trace staged.jsonl --fingerprints fp-staged
  stageload-pixal3d photo.png -o photo.glb --load eager --trace eager.jsonl --stop-after texture
  stageload-pixal3d photo.png -o photo.glb --stream tex_slat_flow_model_1024   # block by block
  stageload report staged.jsonl eager.jsonl

exit codes: 0 done (or stopped by --stop-after), 1 the run failed, 2 usage or port error
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation must not swallow one of the port's options
    )
    p.add_argument(
        "image",
        nargs="+",
        help="input image; several run stage-major, each model loaded once for all of them",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.glb|OUTDIR/",
        help="GLB file to write; with several images (or ending in /), a folder that gets "
        "one IMAGE.glb per image",
    )
    p.add_argument(
        "--port", metavar="DIR", help="Pixal3D-mac checkout (default: $STAGELOAD_PIXAL3D_PORT)"
    )
    p.add_argument(
        "--load",
        choices=LOADS,
        default="staged",
        help="staged (default); auto: the port's own loading under 'stageload auto', its "
        "stages as the plan; eager: the port's own loading, unstaged, for comparison",
    )
    p.add_argument("--trace", metavar="FILE", help="write a memory trace (JSONL) of the run")
    p.add_argument(
        "--interval",
        type=interval,
        default=0.5,
        metavar="SECONDS",
        help="trace sample interval (default 0.5)",
    )
    p.add_argument(
        "--stop-after", choices=STAGES, metavar="STAGE", help="stop the run after this stage"
    )
    p.add_argument(
        "--fingerprints",
        metavar="DIR",
        help="write a sha256 and a copy of each sampler's latent to DIR, to compare runs",
    )
    p.add_argument("--seed", type=int, help="seed, passed to the port (its default: 42)")
    p.add_argument(
        "--build-on",
        choices=("device", "cpu"),
        default="device",
        help="build each model on the device (default, fast) or on the CPU and move it, as "
        "the port does: bit-identical to --load eager where constructors compute buffers "
        "(--load staged; --load auto builds as the port does)",
    )
    p.add_argument(
        "--budget",
        type=budget_arg,
        metavar="SIZE",
        help="keep models loaded across stages while they fit in SIZE ('12G', '80%%', "
        "'auto': the memory available), evicting the one needed furthest ahead; default: "
        "release what the next stage does not use",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="with --budget, load the next stage's models in the background "
        "while the "
        "current stage runs; only loaders that draw no random numbers are prefetched "
        "(docs/residency.md), and a note in the trace names those that are not",
    )
    p.add_argument(
        "--stream",
        type=stream_arg,
        action="append",
        metavar="NAME",
        help="stream this model block by block from its checkpoint instead of loading it "
        "whole (repeat, or separate names with commas); one of: " + ", ".join(MODEL_NAMES),
    )
    p.add_argument(
        "--no-preserve-rng",
        action="store_true",
        help="control experiment: don't restore the RNG around lazy loads (changes the noise)",
    )
    return p


def budget_arg(text: str) -> str:
    """``--budget``: checked by the library's own parser, kept as given ('auto' is read
    when the run starts)."""
    from ..memory.budget import parse_budget

    try:
        parse_budget(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def stream_arg(text: str) -> list[str]:
    """``--stream``: one or more model names separated by commas, each checked."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"names no model: {text!r}")
    try:
        return list(check_stream(names))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def entry() -> None:
    """The ``stageload-pixal3d`` command: :func:`main`. A Ctrl-C ends it by SIGINT, as
    python ends, said in one line (the port's traceback, 15 to 100 lines, said nothing
    more): a shell loop over images stops there, as it would for python."""
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.excepthook = lambda *exc: None  # the interpreter then ends by the signal
        raise
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the port, and return the exit code."""
    parser = build_parser()
    opts, passthrough = parser.parse_known_args(argv)
    for name in opts.image:
        if not Path(name).is_file():
            return _fail(f"image {name!r} is not a file")
    # Everything the run writes is checked now: a bad path must not cost a whole run.
    outputs, problem = _outputs(opts.image, opts.output)
    if problem is not None:
        return _fail(f"--output {opts.output!r}: {problem}")
    if opts.trace is not None:
        problem = unwritable_file(os.path.expanduser(opts.trace))
        if problem is not None:
            return _fail(f"--trace {opts.trace!r}: {problem}")
    if opts.fingerprints is not None:
        problem = unusable_folder(Path(opts.fingerprints).expanduser())
        if problem is not None:
            return _fail(f"--fingerprints {opts.fingerprints!r}: {problem}")

    from ..core.staged import ModelLoadError
    from ..core.streamed import StreamError
    from .adapter import run
    from .plan import UnsupportedPipelineError, plan_for
    from .port import PortError, check_device, find_port, import_port

    try:
        port = import_port(find_port(opts.port))
    except PortError as exc:
        return _fail(str(exc))
    seed = [] if opts.seed is None else ["--seed", str(opts.seed)]
    try:
        images = [
            port.parse_args([name, "--output", str(out), *passthrough, *seed])
            for name, out in zip(opts.image, outputs, strict=True)
        ]
    except SystemExit as exc:  # the port's argparse already said what was wrong
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    args = images[0]
    try:
        plan_for(args.pipeline_type)
        check_device(args.device)
    except (UnsupportedPipelineError, PortError) as exc:
        return _fail(str(exc))

    if opts.prefetch and opts.budget is None:
        return _fail(
            "--prefetch needs --budget SIZE (e.g. --budget auto): with none, each stage "
            "releases what it does not use, so nothing can load ahead"
        )
    stream = list(check_stream(name for names in opts.stream or () for name in names))
    if stream and opts.load == "eager":
        return _fail(
            "--stream needs --load staged or --load auto: the port's own loading (--load "
            "eager) reads each model whole"
        )
    options: dict[str, Any] = {
        "budget": opts.budget,
        "prefetch": opts.prefetch,
        "load": opts.load,
        "preserve_rng": not opts.no_preserve_rng,
        "stop_after": opts.stop_after,
        "fingerprints": opts.fingerprints,
        "build_on": opts.build_on,
        "stream": stream,
    }
    if len(images) > 1:
        from .batch import run_many

        go: Any = functools.partial(run_many, port, images)
    else:
        go = functools.partial(run, port, args)
    try:
        if opts.trace is None:
            result = go(**options)
        else:
            from ..meter import MemoryMeter  # imported here: it is only needed with --trace

            meta = {
                "label": opts.load,
                "command": PROG,
                "load": opts.load,
                "pipeline_type": args.pipeline_type,
                "seed": getattr(args, "seed", None),
                "port": str(port.path),
                "stream": stream,
            }
            with MemoryMeter(opts.trace, opts.interval, meta=meta) as meter:
                result = go(events=meter, **options)
    except (ModelLoadError, PortError, StreamError) as exc:
        return _fail(str(exc), EXIT_FAILED)
    except OSError as exc:  # a file the port could not read or write (e.g. not an image)
        return _fail(f"the run failed: {exc}", EXIT_FAILED)

    failed = False
    for name, one in zip(opts.image, result if isinstance(result, list) else [result], strict=True):
        if isinstance(one, Exception):  # several images: the others ran on
            failed = True
            why = str(one) if isinstance(one, (ModelLoadError, PortError)) else None
            why = why or f"the run failed: {type(one).__name__}: {one}"
            print(f"{PROG}: error: image {name!r}: {why}", file=sys.stderr)
            continue
        if one.stopped_after is not None:
            print(f"stopped after stage {one.stopped_after!r} (--stop-after); no GLB written")
        else:
            print(f"wrote {one.output} ({opts.load} loading)")
        if one.fingerprints_file is not None:
            print(f"fingerprints: {one.fingerprints_file}")
    if opts.trace is not None:
        print(f"trace: {opts.trace}")
    return EXIT_FAILED if failed else EXIT_OK


def _outputs(images: list[str], output: str) -> tuple[list[Path], str | None]:
    """The GLB path of each image, or why ``output`` cannot take them."""
    path = Path(output).expanduser()
    if len(images) == 1 and not output.endswith(("/", os.sep)):
        return [path], unwritable_file(path)
    problem = unusable_folder(path)
    if problem is not None:
        return [], problem
    outputs = [path / f"{Path(name).stem}.glb" for name in images]
    seen: dict[Path, str] = {}
    for name, out in zip(images, outputs, strict=True):
        if out in seen:
            return [], (
                f"images {seen[out]!r} and {name!r} would both write {str(out)!r}; "
                f"give each image its own file name"
            )
        seen[out] = name
    return outputs, None


if __name__ == "__main__":
    entry()
