"""The GPU generations this project has FA4 NVFP4 kernels for: one table, read by the kernels' dispatch
(:mod:`.forward`), the ``fa4`` backend (availability, self-check, ``auto``), the selftest's plan and the measured
policy (:mod:`fusion_pass.runtime.policy`). A new generation is a module beside :mod:`.sm90` / :mod:`.sm100` and
one row here."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GENERATIONS", "Generation", "for_arch"]


@dataclass(frozen=True)
class Generation:
    """One generation: ``name`` (the policy's and the kernels' key, ``"sm90"``), ``label`` (``"SM90"``),
    ``families`` (compute-capability majors it serves), ``gpus`` (what users know it by), ``kernel_module``
    (the CuTe DSL subclass module that needs FA4), ``run_on_hardware`` (this project ran and byte-checked the
    kernel on such a GPU; if not, the kernel self-checks before its first use) and ``formats`` (the output formats
    whose kernels the run time calls there, by :data:`fusion_pass.formats.FORMATS` name: a format is listed once its
    kernel's GPU byte tests have passed on such a GPU, because the first-use self-check's canary is NVFP4's: SM90's
    static and 128-column group FP8 epilogues passed them on an H100; SM100's FP8 output stage is compiled only)."""

    name: str
    label: str
    families: tuple[int, ...]
    gpus: str
    kernel_module: str
    run_on_hardware: bool
    formats: tuple[str, ...] = ("nvfp4",)


GENERATIONS: tuple[Generation, ...] = (
    Generation("sm90", "SM90", (9,), "H100, H200", "sm90_kernel", True,
               ("nvfp4", "fp8_static", "fp8_group128", "fp8_group128_ue8m0")),
    Generation("sm100", "SM100/SM110", (10, 11), "B200, GB200", "sm100_kernel", False),
)


def for_arch(arch: int | None) -> Generation | None:
    """The generation of compute capability ``arch`` (``major * 10 + minor``), or None."""
    if arch is None:
        return None
    return next((g for g in GENERATIONS if arch // 10 in g.families), None)
