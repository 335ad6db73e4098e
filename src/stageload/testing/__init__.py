"""Test support shipped for users' own tests: real pipelines built locally with random weights.

``stageload.testing.diffusers`` builds diffusers pipelines (Qwen-Image, Flux, SD3, Wan 2.2)
with tokenizers trained in code; it needs the ``diffusers`` extra. ``stageload.testing.cgroup``
makes real memory cgroups with a limit (Linux, root), runs commands or functions inside
them and reads what the kernel charged and killed. ``stageload.testing.families`` builds
19 more pipeline families, tiny, for the tests of ``staged_pipeline`` on any pipeline.
"""
