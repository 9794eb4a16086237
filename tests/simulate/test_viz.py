"""Tests for ``pagedkv.simulate.pagemap`` and ``plots``: page maps, their text, PNGs, the missing extra."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.simulate import Budget, PagedEngine, Request, SimConfig, Workload, run_policy, sweep, synthetic
from pagedkv.simulate.kernel import load_kernel_cost
from pagedkv.simulate.pagemap import FREE, SHARED, PageMap, capture_page_maps, page_map_text, take_page_map
from pagedkv.simulate.plots import MissingExtraError, plot_occupancy, plot_page_map
from pagedkv.simulate.plots_sweep import plot_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_page_map_of_a_hand_built_state() -> None:
    # Request 0: prompt 6, n=2 -> after prefill both samples share xxxx|xx__;
    # request 1: prompt 3 -> xxx_. Pool of 6 blocks of 4.
    workload = Workload((Request(0, 6, 4, n=2), Request(1, 3, 4)))
    page_maps, _ = capture_page_maps(workload, SimConfig(Budget(24), block_size=4, watermark=0.0), [0, 1])
    first = page_maps[0]
    assert first.owner.tolist() == [0, 0, 1, FREE, FREE, FREE]
    assert first.num_refs.tolist() == [2, 2, 1, 0, 0, 0]
    assert first.num_live.tolist() == [4, 2, 3, 0, 0, 0]
    text = page_map_text(first, legend=False)
    assert text.splitlines()[0] == (
        "step 0: 6 blocks x 4 slots; 3 used (2 shared), 0 cached free, 3 free; 9 live tokens = 37.5%"
    )
    assert "  owner  AAb..." in text and "  fill   =--" in text and "requests a=#0 b=#1" in text
    # Step 1: the samples diverged; the partial block was copied for one of them.
    second = page_maps[1]
    assert second.num_refs.tolist().count(2) == 1 and int((second.owner == 0).sum()) == 3


def test_shared_and_cached_free_blocks_are_marked() -> None:
    workload = synthetic("alpaca", 10, seed=0, num_prefix_groups=1, prefix_len=8, max_model_len=256)
    config = SimConfig(Budget(128), block_size=4, enable_prefix_caching=True)
    page_maps, result = capture_page_maps(workload, config)
    assert page_maps[0].step == 0 and len(page_maps) == result.num_steps
    assert any((page_map.owner == SHARED).any() for page_map in page_maps)  # the system prompt
    assert any(page_map.cached_free.any() for page_map in page_maps)  # freed blocks that stay findable
    for page_map in page_maps:
        used = page_map.owner != FREE
        assert (page_map.num_refs[used] >= 1).all() and (page_map.num_refs[~used] == 0).all()
        assert not (page_map.cached_free & used).any()
    marks = "".join(page_map_text(page_map, legend=False) for page_map in page_maps)
    assert "#" in marks and "+" in marks


def test_page_map_wraps_rows_and_counts_match_the_engine() -> None:
    workload = synthetic("alpaca", 8, seed=2, max_model_len=256)
    config = SimConfig(Budget(300), block_size=2)
    taken: list[tuple[PageMap, int]] = []
    PagedEngine(workload, config).run(observer=lambda e: taken.append((take_page_map(e), e.live_slots()[0])))
    for page_map, num_live in taken[:20]:
        assert int(page_map.num_live.sum()) == num_live
    text = page_map_text(taken[0][0], width=50)
    owners = [line for line in text.splitlines() if line.startswith("  owner")]
    assert [len(line) - len("  owner  ") for line in owners] == [50, 50, 50]
    assert "  block  100" in text  # the ruler names the first block of the third row


def test_capture_thins_long_runs() -> None:
    workload = synthetic("alpaca", 6, seed=0, max_model_len=256)
    page_maps, result = capture_page_maps(workload, SimConfig(Budget(64), block_size=4), max_page_maps=10)
    assert len(page_maps) == 10 and page_maps[0].step == 0 and page_maps[-1].step == result.num_steps - 1


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_pngs_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    workload = synthetic("alpaca", 12, seed=0, n=2, num_prefix_groups=1, prefix_len=8, max_model_len=256)
    config = SimConfig(Budget(256), block_size=4, enable_prefix_caching=True)
    page_maps, _ = capture_page_maps(workload, config)
    _assert_png(plot_page_map(page_maps, tmp_path / "pagemap.png"))
    paged = run_policy("paged", workload, config)
    contiguous = run_policy("contiguous", workload, config)
    _assert_png(plot_occupancy(paged, contiguous, tmp_path / "sub" / "occupancy.png"))
    rows = sweep(workload, config, [1, 4, 16])
    _assert_png(plot_sweep(rows, tmp_path / "sweep.png"))
    _assert_png(plot_sweep(rows, tmp_path / "sweep_kernel.png", kernel=load_kernel_cost()))
    assert np.asarray(page_maps[0].owner).dtype == np.int64


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    page_maps, _ = capture_page_maps(Workload((Request(0, 3, 2),)), SimConfig(Budget(16), block_size=4))
    with pytest.raises(MissingExtraError, match=r'pip install "pagedkv\[plot\]"'):
        plot_page_map(page_maps, tmp_path / "x.png")
    assert issubclass(MissingExtraError, ImportError)
    assert not (tmp_path / "x.png").exists()


def _sweep_axes(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> list[Any]:
    """Draw a tiny sweep and return its axes (the figure is kept from closing)."""
    import matplotlib.pyplot as plt

    from pagedkv.simulate import plots_sweep

    drawn: list[Any] = []
    monkeypatch.setattr(plots_sweep, "save_figure", lambda plt, figure, path: drawn.append(figure) or path)
    workload = synthetic("alpaca", 8, seed=0, max_model_len=256)
    rows = sweep(workload, SimConfig(Budget(256), block_size=4), [4, 16, 3])
    plot_sweep(rows, "unused.png", kernel=kernel)
    (figure,) = drawn
    axes = list(figure.axes)
    plt.close(figure)
    return axes


def test_sweep_picture_has_a_kernel_panel_next_to_the_memory_panel(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    kernel = load_kernel_cost()
    axes = _sweep_axes(monkeypatch, kernel)
    memory, kernel_ax, what_if = axes[0], axes[1], axes[4]
    assert memory.get_title().startswith("memory")
    assert kernel_ax.get_title().startswith("kernel")
    lines = {line.get_label(): list(line.get_ydata()) for line in kernel_ax.get_lines()}
    assert lines["gather"] == [point.gather_ms for point in kernel.points]
    assert lines["views"] == [point.view_ms for point in kernel.points]
    assert lines["contiguous"] == [point.contiguous_ms for point in kernel.points]
    # The what-if panel draws only the sweep's measured block sizes (4 and 16, not 3).
    gather = next(line for line in what_if.get_lines() if line.get_label() == "gather")
    assert list(gather.get_xdata()) == [4, 16]


def test_sweep_picture_without_kernel_cost_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    axes = _sweep_axes(monkeypatch, None)
    texts = [text.get_text() for text in axes[1].texts]
    assert texts == ["no kernel cost given\n(--kernel-cost PATH)"]
    assert not axes[1].get_lines()


def _drawn_figure(monkeypatch: pytest.MonkeyPatch, module: Any, draw: Any) -> Any:
    """Run ``draw()`` with ``module.save_figure`` keeping the figure; return it (closed by the caller)."""
    drawn: list[Any] = []
    monkeypatch.setattr(module, "save_figure", lambda plt, figure, path: drawn.append(figure) or path)
    draw()
    (figure,) = drawn
    return figure


def test_page_map_legend_names_only_the_states_in_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from pagedkv.simulate import plots

    # One sample per request, no prefix caching: no forks, no shared or cached free blocks.
    workload = synthetic("alpaca", 6, seed=0, max_model_len=256)
    page_maps, _ = capture_page_maps(workload, SimConfig(Budget(256), block_size=4))
    assert plots.page_map_states(page_maps) == {"one", "free"}
    figure = _drawn_figure(monkeypatch, plots, lambda: plot_page_map(page_maps, "unused.png"))
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    plt.close(figure)
    assert labels == ["held by one sequence (a colour per request)", "free"]


def test_a_system_off_the_latency_scale_is_still_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from pagedkv.simulate import plots_serving
    from pagedkv.simulate.ratesweep import rate_sweep

    config = SimConfig(Budget(4096), block_size=16)
    points = rate_sweep("alpaca", 12, config, (1.0, 2.0), ["paged", "contiguous"])
    y_max = min(point.result.latency.normalised_mean for point in points) / 2  # every point off the scale
    def draw() -> None:
        plots_serving.plot_rate_sweep({"p": points}, "unused.png", y_max=y_max)

    figure = _drawn_figure(monkeypatch, plots_serving, draw)
    (axes,) = figure.axes
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    markers = [line for line in axes.get_lines() if line.get_marker() == "^" and len(line.get_xdata())]
    plt.close(figure)
    assert f"reserve max length (Orca (Max)): above {y_max:g} at every rate" in legend
    assert f"off the scale (above {y_max:g})" in legend
    # Each system's two points sit on the top edge as triangles, in its own colour.
    assert sorted(line.get_color() for line in markers) == sorted(["#1565c0", "#6d4c41"])
    assert all(list(line.get_ydata()) == [y_max, y_max] for line in markers)
