"""The decode benchmark's tables, printed with the CPU and its tier (`qkv.native.machine.machine_line`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from qkv.bench._decode import PAGE, DecodeRow, GenerationRow, PagedRow
from qkv.native.machine import machine_line

__all__ = ["print_decode", "print_generation", "print_paged"]


def _capped(softcap: float | None) -> str:
    return "" if softcap is None else f", qkv with softcap {softcap:g} (SDPA: none)"


def print_decode(rows: list[DecodeRow], console: Console, softcap: float | None = None) -> None:
    """One line per cache length and dtype: times, the qkv / SDPA ratio, K + V GB/s and the fraction of bandwidth."""
    bandwidth = max(row.bandwidth for row in rows)
    table = Table(
        title=f"decode step, B=1 Hq=32 G=8 E=128, causal{_capped(softcap)}; read bandwidth {bandwidth / 1e9:.1f} GB/s "
        "(torch.sum over 512 MiB, same run)\n" + machine_line()
    )
    for column in ("S", "dtype", "qkv path", "qkv ms", "SDPA ms", "qkv vs SDPA", "qkv K+V GB/s", "of bandwidth", "SDPA GB/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row.S:,}", row.dtype, row.path, f"{row.qkv_seconds * 1e3:.2f}", f"{row.sdpa_seconds * 1e3:.2f}",
            f"{row.ratio:.2f}x", f"{row.qkv_rate / 1e9:.2f}", f"{row.qkv_rate / row.bandwidth:.0%}",
            f"{row.sdpa_rate / 1e9:.2f}",
        )  # fmt: skip
    console.print(table)


def print_paged(rows: list[PagedRow], console: Console, softcap: float | None = None) -> None:
    """One line per cache length and dtype: the paged step (one run, fragmented) against the
    contiguous cache's and SDPA's, as ratios of times."""
    table = Table(
        title=f"decode step over a PagedKVCache ({PAGE}-position blocks), B=1 Hq=32 G=8 E=128, causal{_capped(softcap)}\n"
        + machine_line()
    )
    for column in ("S", "dtype", "contiguous ms", "paged ms", "fragmented ms", "SDPA ms", "paged vs contiguous",
                   "paged vs SDPA", "fragmented vs SDPA", "fragmented vs contiguous"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row.S:,}", row.dtype, f"{row.contiguous_seconds * 1e3:.1f}", f"{row.paged_seconds * 1e3:.1f}",
            f"{row.fragmented_seconds * 1e3:.1f}", f"{row.sdpa_seconds * 1e3:.1f}",
            f"{row.contiguous_seconds / row.paged_seconds:.2f}x", f"{row.sdpa_seconds / row.paged_seconds:.2f}x",
            f"{row.sdpa_seconds / row.fragmented_seconds:.2f}x", f"{row.contiguous_seconds / row.fragmented_seconds:.2f}x",
        )  # fmt: skip
    console.print(table)


def print_generation(rows: list[GenerationRow], console: Console) -> None:
    """Time to first token and decode tokens per second per attention implementation."""
    table = Table(title="greedy generation, random Llama-shaped model, float32\n" + machine_line())
    for column in ("attn_implementation", "cache", "prompt", "new tokens", "first token s", "tokens/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.implementation, row.cache, f"{row.prompt:,}", str(row.new_tokens), f"{row.first_token_seconds:.2f}",
            f"{row.tokens_per_second:.2f}",
        )  # fmt: skip
    console.print(table)
