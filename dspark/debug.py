"""The debug switches: the only environment variables the package reads (once, at import).

    DSPARK_REFERENCE_KERNELS=1   the torch reference code instead of the fused Triton kernels
                                 (mHC, RMSNorm / RoPE and the decode fusions built on them,
                                 sampling and verification): to tell a kernel bug from a model bug
    DSPARK_NO_PDL=1              no programmatic dependent launch: every kernel starts after the
                                 one ahead of it has finished (dspark.cuda.pdl)
    DSPARK_NO_SIDE_STREAMS=1     every branch of the decode step inline on the current stream
                                 (dspark.cuda.side_stream): no concurrency inside a step

Each is "1" (on) or unset / "0" (off, the shipped behaviour); any other value is an error. The
modules that act on them read the attributes below at call time, so a test or a benchmark may
set them (monkeypatch.setattr(debug, "NO_PDL", True)) instead of the environment. Everything
else that was once a switch is either the code (the variant that measured faster) or a tuning
table next to its kernel.
"""
import os

SWITCHES = ("DSPARK_REFERENCE_KERNELS", "DSPARK_NO_PDL", "DSPARK_NO_SIDE_STREAMS")


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{name}={value!r}: use 1 (on) or 0 / unset (off)")
    return value == "1"


REFERENCE_KERNELS = _flag("DSPARK_REFERENCE_KERNELS")
NO_PDL = _flag("DSPARK_NO_PDL")
NO_SIDE_STREAMS = _flag("DSPARK_NO_SIDE_STREAMS")
