"""The memory figures of ``docs/tutorial.md``, at fixed settings: page maps, occupancy, the sweep.

``pagedkv viz --all --out docs/images`` writes these and the serving figures of
:mod:`pagedkv.simulate.plots_serving`. The ``plot`` extra (matplotlib), as
:mod:`pagedkv.simulate.plots`, whose drawing functions it calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.simulate.config import Budget, ModelShape, SimConfig, parse_bytes
from pagedkv.simulate.pagemap import capture_page_maps
from pagedkv.simulate.plots import plot_occupancy, plot_page_map, pyplot
from pagedkv.simulate.plots_sweep import plot_sweep
from pagedkv.simulate.report import run_policy, sweep
from pagedkv.simulate.synthetic import synthetic

__all__ = ["tutorial_figures"]


def tutorial_figures(out_dir: str | Path, *, kernel: Any = None, log: Any = print) -> list[Path]:
    """Write the tutorial's figures (fixed settings, see ``docs/tutorial.md``) into ``out_dir``.

    Args:
        out_dir: the folder.
        kernel: the measured kernel cost for the sweep's kernel panel (a
            :class:`~pagedkv.simulate.kernel.KernelCost`; None leaves it out).
        log: called with a line per file written.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    pyplot()
    out = Path(out_dir)
    written = []
    # 1. The page map over time: Alpaca-like requests arriving, two system prompts, prefix caching.
    workload = synthetic("alpaca", 30, seed=0, num_prefix_groups=2, prefix_len=12, arrival_rate=0.4)
    config = SimConfig(Budget.from_blocks(96, 4), block_size=4, enable_prefix_caching=True)
    page_maps, _ = capture_page_maps(workload, config)
    written.append(
        plot_page_map(
            page_maps,
            out / "pagemap.png",
            title="Page map over time: 30 Alpaca-like requests arriving, 2 system "
            "prompts, prefix caching (96 blocks x 4)",
        )
    )
    log(f"wrote {written[-1]}")
    # 1b. Forks: parallel sampling n=4.
    workload = synthetic("alpaca", 16, seed=0, n=4, sampling="beam")
    config = SimConfig(Budget.from_blocks(96, 4), block_size=4)
    page_maps, _ = capture_page_maps(workload, config)
    written.append(
        plot_page_map(
            page_maps,
            out / "pagemap_beam.png",
            title="Page map over time: 16 Alpaca-like requests, beam-like search "
            "with 4 beams (96 blocks x 4)",
        )
    )
    log(f"wrote {written[-1]}")
    # 2. Occupancy over time: ShareGPT-like, OPT-13B, 12 GiB.
    workload = synthetic("sharegpt", 300, seed=0)
    config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16)
    paged = run_policy("paged", workload, config)
    contiguous = run_policy("contiguous", workload, config)
    written.append(
        plot_occupancy(
            paged,
            contiguous,
            out / "occupancy.png",
            title="KV memory over time: 300 ShareGPT-like requests, OPT-13B, 12 GiB of KV memory",
        )
    )
    log(f"wrote {written[-1]}")
    # 3. The block-size sweep, with a shared 100-token system prompt and prefix caching.
    workload = synthetic("sharegpt", 300, seed=0, num_prefix_groups=1, prefix_len=100)
    config = SimConfig(
        Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16, enable_prefix_caching=True
    )
    rows = sweep(workload, config, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    written.append(
        plot_sweep(
            rows,
            out / "block_size_sweep.png",
            kernel=kernel,
            title="The block-size trade-off: 300 ShareGPT-like requests sharing a "
            "100-token system prompt, 12 GiB",
        )
    )
    log(f"wrote {written[-1]}")
    return written
