"""`qkv doctor`: what this machine offers qkv, and building the compiled kernels ahead of time.

    qkv doctor              the CPU tier and features, bf16/fp16 native or not, the torch build,
                            each compiled kernel: may it run here, is it built, and why not
    qkv doctor --json       the same as JSON
    qkv doctor --build      build every kernel that may run here now, saying how long each took
                            (exit status 1 when one of them failed)
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from qkv.cli._app import app, say
from qkv.cli._options import JsonOption

__all__ = ["doctor_command", "machine_report"]


def machine_report(build: bool = False) -> dict[str, Any]:
    """Everything `qkv doctor` prints, as plain data (``build``: build the kernels first)."""
    import torch

    from qkv.native import inventory
    from qkv.native.machine import TIER_VARIABLE, cpu_features, cpu_model

    features = cpu_features()
    kernels = inventory.build_all() if build else inventory.kernel_statuses()
    return {
        "cpu": cpu_model(),
        "tier": features.tier,
        "detected_tier": features.detected,
        "tier_note": features.note,
        "forced_by": f"{TIER_VARIABLE}={features.forced}" if features.tier != features.detected else None,
        "torch_capability": features.capability,
        "features": {"avx512_bf16": features.avx512_bf16, "amx": features.amx, "amx_fp16": features.amx_fp16},
        "native": {"bfloat16": features.native(torch.bfloat16), "float16": features.native(torch.float16)},
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "onednn": torch.backends.mkldnn.is_available(),
        "threads": torch.get_num_threads(),
        "kernels": [_kernel_entry(k) for k in kernels],
    }


def _kernel_entry(kernel: Any) -> dict[str, Any]:
    return {
        "name": kernel.name,
        "stem": kernel.stem,
        "available": kernel.reason is None,
        "reason": kernel.reason,
        "built": kernel.built,
        "folder": kernel.folder,
        "seconds": kernel.seconds,
    }


@app.command("doctor")
def doctor_command(
    as_json: JsonOption = False,
    build: Annotated[bool, typer.Option("--build", help="Build every compiled kernel that can run here now.")] = False,
) -> None:
    """What this machine offers qkv: CPU tier, native dtypes, torch build, compiled kernels.
    With --build the exit status is 1 when a kernel that may run here failed to build."""
    report = machine_report(build)
    # a kernel whose attempt was timed yet cannot run: its build (or self-check) failed
    failed = [k for k in report["kernels"] if k["seconds"] is not None and not k["available"]]
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        if failed:
            raise typer.Exit(1)
        return
    native = report["native"]
    tier = report["tier"] if report["forced_by"] is None else f"{report['tier']} ({report['forced_by']}; the machine is {report['detected_tier']})"
    say(f"CPU: {report['cpu']}")
    say(f"tier: {tier}; PyTorch's kernels: {report['torch_capability']}")
    if report["tier_note"]:
        say(f"note: {report['tier_note']}")
    for dtype in ("bfloat16", "float16"):
        state = "native" if native[dtype] else "not native: qkv computes its products in float32"
        say(f"{dtype}: {state}")
    cuda = f", CUDA {report['torch_cuda']}" if report["torch_cuda"] else ", CPU only"
    say(f"torch {report['torch']}{cuda}, oneDNN {'on' if report['onednn'] else 'absent'}, {report['threads']} threads")
    say("compiled kernels:")
    for kernel in report["kernels"]:  # one line each, never wrapped: the folder stays copy-pasteable
        took = "" if kernel["seconds"] is None else f" in {kernel['seconds']:.1f} s"
        if kernel["available"]:
            state = f"built{took}, {kernel['folder']}" if kernel["built"] else f"not built yet ({kernel['folder']})"
            say(f"- {kernel['name']}: runs here, {state}")
        else:
            say(f"- {kernel['name']}: does not run here: {kernel['reason']}")
    if failed:
        attempted = sum(k["seconds"] is not None for k in report["kernels"])
        say(f"{len(failed)} of {attempted} builds failed (each line above says why); qkv runs their calls on its portable paths")
        raise typer.Exit(1)
