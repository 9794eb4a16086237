"""Tests for ``pagedkv.simulate``: workloads, the paged engine on the real manager, the contiguous baseline.

Block states are drawn with one character per slot: ``x`` a live token, ``_``
an empty slot of a held block, ``|`` between blocks.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import pytest

from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.manager.manager import SequenceState
from pagedkv.simulate import (
    Budget,
    BudgetError,
    ContiguousEngine,
    FirstFit,
    ModelShape,
    PagedEngine,
    Request,
    SimConfig,
    Workload,
    WorkloadError,
    format_report,
    format_sweep,
    load_jsonl,
    parse_bytes,
    parse_jsonl,
    run_policy,
    simulate,
    sweep,
    synthetic,
)
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.requests import RequestState

# ----------------------------------------------------------------- workloads


@pytest.mark.parametrize(
    ("dataset", "prompt_mean", "output_mean"), [("sharegpt", 161, 338), ("alpaca", 19.31, 58.45)]
)
def test_synthetic_lengths_have_the_papers_means(
    dataset: str, prompt_mean: float, output_mean: float
) -> None:
    stats = synthetic(dataset, 20000, seed=0).stats()
    assert stats["mean_prompt_len"] == pytest.approx(prompt_mean, rel=0.03)
    assert stats["mean_output_len"] == pytest.approx(output_mean, rel=0.03)
    assert isinstance(stats["max_seq_len"], int) and stats["max_seq_len"] <= 2048


def test_synthetic_is_deterministic_for_a_seed() -> None:
    first, again, other = (synthetic("sharegpt", 50, seed=s) for s in (3, 3, 4))
    assert first == again
    assert first.requests != other.requests
    assert first.prompt_tokens(first.requests[7]) == again.prompt_tokens(again.requests[7])


def test_prefix_groups_share_their_system_prompt_and_nothing_else() -> None:
    workload = synthetic("alpaca", 40, seed=0, num_prefix_groups=2, prefix_len=10)
    by_group: dict[str | None, list[list[int]]] = {}
    for request in workload.requests:
        assert request.prefix_len == 10 and request.prompt_len > 10
        tokens = workload.prompt_tokens(request)
        assert len(tokens) == request.prompt_len
        by_group.setdefault(request.prefix_group, []).append(tokens)
    assert len(by_group) == 2
    heads = {key: {tuple(t[:10]) for t in prompts} for key, prompts in by_group.items()}
    assert all(len(h) == 1 for h in heads.values())  # one system prompt per group
    assert len(set.union(*heads.values())) == 2  # the two groups differ
    rests = [tuple(t[10:]) for prompts in by_group.values() for t in prompts]
    assert len(set(rests)) == len(rests)


def test_synthetic_rejects_bad_parameters() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'lmsys'"):
        synthetic("lmsys", 10)
    with pytest.raises(WorkloadError, match="num_requests must be an int >= 1, got 0"):
        synthetic("alpaca", 0)
    with pytest.raises(WorkloadError, match="sampling"):
        synthetic("alpaca", 3, sampling="greedy")


def test_jsonl_schema_defaults_and_explicit_prompts(tmp_path: Any) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "# a comment, then a blank line\n\n"
        '{"prompt_len": 6, "output_len": 3, "prefix_group": "sys"}\n'
        '{"prompt": [5, 6, 7, 8], "output_len": 2, "n": 2, "sampling": "beam", "arrival_step": 4}\n'
        '{"prompt_len": 9, "output_len": 1, "prefix_group": "sys", "max_output_len": 50}\n'
    )
    workload = load_jsonl(path)
    first, third, second = workload.requests  # sorted by arrival step (stable)
    assert (first.prompt_len, first.output_len, first.n, first.prefix_len) == (6, 3, 1, 6)
    assert third.prefix_len == 6  # the group's shortest prompt by default
    assert (second.prompt, second.n, second.sampling, second.arrival_step) == ((5, 6, 7, 8), 2, "beam", 4)
    assert workload.prompt_tokens(second) == [5, 6, 7, 8]
    assert workload.prompt_tokens(first) == workload.prompt_tokens(third)[:6]
    assert workload.max_output_len(third) == 50
    assert workload.max_output_len(first) == 2048 - 6


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt_len": 4', "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"prompt_len": 4}', "line 2: field 'output_len' is required"),
        ('{"output_len": 4}', "line 2: field 'prompt_len' is required"),
        ('{"prompt_len": "4", "output_len": 1}', "line 2: field 'prompt_len' must be an int >= 1, got '4'"),
        ('{"prompt_len": 4, "output_len": 0}', "line 2: field 'output_len' must be an int >= 1, got 0"),
        ('{"prompt_len": 4, "output_len": 1, "n": true}', "line 2: field 'n' must be an int >= 1"),
        ('{"prompt": [1, -2], "output_len": 1}', "line 2: field 'prompt' must be a non-empty list"),
        (
            '{"prompt": [1, 2], "prompt_len": 3, "output_len": 1}',
            "line 2: field 'prompt_len' is 3 but 'prompt'",
        ),
        (
            '{"prompt_len": 4, "output_len": 1, "sampling": "greedy"}',
            "line 2: field 'sampling' must be one of",
        ),
        ('{"prompt_len": 4, "output_len": 1, "colour": 1}', "line 2: unknown field 'colour'"),
        (
            '{"prompt_len": 4, "output_len": 1, "prefix_len": 2}',
            "line 2: field 'prefix_len' needs a 'prefix_group'",
        ),
        ('{"prompt_len": 4, "output_len": 5, "max_output_len": 4}', "line 2: field 'max_output_len' is 4"),
    ],
)
def test_a_malformed_jsonl_line_names_its_number_and_field(line: str, message: str) -> None:
    with pytest.raises(WorkloadError, match="^reqs.jsonl " + message.replace("(", r"\(").replace("[", r"\[")):
        parse_jsonl(['{"prompt_len": 2, "output_len": 2}', line], source="reqs.jsonl")


def test_missing_or_empty_jsonl_files_fail_clearly(tmp_path: Any) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n# nothing\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl")
    assert issubclass(WorkloadError, PagedKVError) and issubclass(WorkloadError, ValueError)


# -------------------------------------------------------------- config


def test_bytes_become_token_slots_through_the_modeled_kv_size() -> None:
    model = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)  # Llama-3-8B
    assert model.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    budget = Budget.from_bytes(parse_bytes("1GiB"), model)
    assert budget.num_tokens == 8192 and budget.num_blocks(16) == 512
    assert parse_bytes("800MB") == 800_000_000 and parse_bytes(" 2.5 KiB ") == 2560
    for text in ("12 potatoes", "GiB", "-1GB", ""):
        with pytest.raises(BudgetError, match="not a memory size"):
            parse_bytes(text)


def test_a_budget_smaller_than_one_block_is_refused() -> None:
    with pytest.raises(BudgetError, match="smaller than one block: 100000 bytes hold 0 token slots"):
        SimConfig(Budget.from_bytes(100_000, ModelShape()), block_size=16)
    with pytest.raises(BudgetError, match="holds 15 token slots, one block is 16"):
        SimConfig(Budget(15), block_size=16)


def test_a_prompt_larger_than_the_whole_pool_is_refused_up_front() -> None:
    workload = Workload((Request(0, 4, 2), Request(1, 40, 2)))
    with pytest.raises(
        BudgetError, match="request 1's prompt of 40 tokens needs 10 blocks of 4, the memory holds 8"
    ):
        PagedEngine(workload, SimConfig(Budget(32), block_size=4))


def test_bad_settings_raise_config_errors() -> None:
    for field, value in (("block_size", 0), ("sample_every", 0), ("max_size", 0), ("watermark", 1.0)):
        with pytest.raises(ConfigError, match=field):
            SimConfig(Budget(64), **{field: value})
    with pytest.raises(ConfigError, match="unknown policy 'fifo'"):
        simulate(synthetic("alpaca", 2), SimConfig(Budget(64), block_size=4), ["fifo"])
    with pytest.raises(WorkloadError, match="n=3 samples, more than max_num_seqs=2"):
        PagedEngine(synthetic("alpaca", 2, n=3), SimConfig(Budget(512), block_size=4, max_num_seqs=2))


# ------------------------------------------------- paged engine, hand-checked


def test_paged_occupancy_of_one_request_by_hand() -> None:
    # Prompt 5, output 3, blocks of 4, a pool of 8 blocks = 32 slots:
    #   step 0  xxxx|x___   live 5, held 2 blocks (3 empty slots)
    #   step 1  xxxx|xx__   live 6
    #   step 2  xxxx|xxx_   live 7
    #   step 3  xxxx|xxxx   live 8, then freed
    workload = Workload((Request(0, 5, 3),))
    result = PagedEngine(workload, SimConfig(Budget(32), block_size=4, sample_every=1)).run()
    assert (result.num_steps, result.num_finished, result.num_decode_tokens) == (4, 1, 3)
    assert result.occupancy_mean == pytest.approx((5 + 6 + 7 + 8) / 4 / 32)
    assert result.occupancy_peak == pytest.approx(8 / 32)
    assert result.unfilled_mean == pytest.approx((3 + 2 + 1 + 0) / 4 / 32)
    assert result.waste_of_used_mean == pytest.approx((3 / 8 + 2 / 8 + 1 / 8 + 0) / 4)


def test_preemption_takes_the_newest_request_and_it_recomputes_later() -> None:
    # Two requests, prompt 4 and output 8, on 4 blocks of 4 (no watermark):
    #   step 4  A xxxx|xxxx  B xxxx|xxxx   the pool is full, both blocks full
    #   step 5  A needs a block and so does B: B (admitted last) is preempted,
    #           its 8 tokens forgotten; A takes one of its blocks
    #   step 8  A writes its 12th token and is freed
    #   step 9  B comes back: 8 tokens re-fed in one prefill, then 4 decode steps
    workload = Workload((Request(0, 4, 8), Request(1, 4, 8)))
    config = SimConfig(Budget(16), block_size=4, watermark=0.0, sample_every=1, check_every_step=True)
    states: dict[int, dict[int, SequenceState]] = {}

    def observe(engine: PagedEngine) -> None:
        manager = engine.manager
        states[engine.step] = {engine.seq_owner[s]: manager.state(s) for s in manager.seq_ids}

    result = PagedEngine(workload, config).run(observer=observe)
    assert states[4] == {0: SequenceState.RUNNING, 1: SequenceState.RUNNING}
    assert states[5] == {0: SequenceState.RUNNING, 1: SequenceState.PREEMPTED}
    assert states[9] == {1: SequenceState.RUNNING}
    assert (result.num_preemptions, result.num_recomputed_tokens, result.num_steps) == (1, 8, 14)
    assert result.num_finished == 2 and result.num_generated_tokens == 16


def test_a_request_that_outgrows_the_whole_pool_alone_is_aborted() -> None:
    workload = Workload((Request(0, 4, 100), Request(1, 4, 4)))
    config = SimConfig(Budget(16), block_size=4, check_every_step=True)
    result = PagedEngine(workload, config).run()
    assert (result.num_finished, result.num_aborted) == (1, 1)


def test_forks_share_the_prompt_until_they_diverge() -> None:
    # n=4 samples of a 9-token prompt: after prefill they share 3 blocks
    # (xxxx|xxxx|x___); the first decode copies the partial block for three.
    workload = Workload((Request(0, 9, 2, n=4),))
    config = SimConfig(Budget(64), block_size=4, sample_every=1, check_every_step=True)
    saved: list[int] = []
    PagedEngine(workload, config).run(
        observer=lambda e: saved.append(e.live_slots()[1] - e.pool.num_used_blocks)
    )
    assert saved == [3 * 3, 2 * 3, 2 * 3]


# ----------------------------------------- invariants at every step, many shapes

CASES = {
    "plain": {},
    "prefix caching": {"prefix": True},
    "shared prompts, parallel n=3": {"n": 3, "groups": 2, "prefix_len": 12, "prefix": True, "blocks": 128},
    "beam n=4 without prefix caching": {"n": 4, "sampling": "beam", "blocks": 80},
    "beam n=2, window, arrivals": {
        "n": 2,
        "sampling": "beam",
        "groups": 2,
        "prefix_len": 16,
        "prefix": True,
        "window": 24,
        "rate": 0.5,
    },
    "window, max_num_seqs": {
        "groups": 2,
        "prefix_len": 16,
        "prefix": True,
        "window": 16,
        "bs": 8,
        "max_seqs": 6,
    },
    "tiny pool, big blocks": {
        "n": 3,
        "sampling": "beam",
        "groups": 3,
        "prefix_len": 20,
        "prefix": True,
        "bs": 16,
        "blocks": 12,
    },
    "block size 1": {"n": 2, "bs": 1, "blocks": 400, "window": 10, "rate": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_bookkeeping_agrees_with_the_manager_at_every_step(case: str) -> None:
    options = CASES[case]
    workload = synthetic(
        "alpaca",
        16,
        seed=3,
        n=options.get("n", 1),
        sampling=options.get("sampling", "parallel"),
        num_prefix_groups=options.get("groups", 0),
        prefix_len=options.get("prefix_len", 0),
        arrival_rate=options.get("rate"),
    )
    bs = options.get("bs", 4)
    config = SimConfig(
        Budget.from_blocks(options.get("blocks", 64), bs),
        block_size=bs,
        max_size=options.get("window"),
        enable_prefix_caching=options.get("prefix", False),
        max_num_seqs=options.get("max_seqs"),
        check_every_step=True,  # check_invariants() and check_consistency() after every step
    )
    result = PagedEngine(workload, config).run()
    assert result.num_finished + result.num_aborted == 16
    assert result.num_finished >= 12
    assert result.num_samples == result.num_steps


def test_the_consistency_check_catches_a_leaked_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = synthetic("alpaca", 6, seed=0, n=2)
    config = SimConfig(Budget(256), block_size=4, check_every_step=True)
    engine = PagedEngine(workload, config)
    schedule = engine.schedule
    finish = schedule.finish

    def leaky_finish(step: int) -> None:
        for live in schedule.running:
            if live.state is RequestState.RUNNING and live.finish_step == step:
                live.seq_ids.pop()  # forget one sequence without freeing it
        finish(step)

    monkeypatch.setattr(schedule, "finish", leaky_finish)
    with pytest.raises(AssertionError, match="the manager knows"):
        engine.run()


# ------------------------------------------------------- contiguous baseline


def test_contiguous_occupancy_by_hand() -> None:
    # Budget 100 slots; max_model_len 40, so every request reserves 40.
    #   A, B: prompt 10, output 5     C: prompt 20, output 3
    #   steps 0-5: A and B hold 10..15 tokens each; C waits (the 20-slot hole is too small)
    #   steps 6-9: C holds 20..23 tokens
    workload = Workload((Request(0, 10, 5), Request(1, 10, 5), Request(2, 20, 3)), max_model_len=40)
    result = ContiguousEngine(workload, Budget(100), sample_every=1).run()
    live = [20, 22, 24, 26, 28, 30, 20, 21, 22, 23]
    reserved = [80] * 6 + [40] * 4
    final = [30] * 6 + [23] * 4
    assert result.num_steps == 10 and result.num_finished == 3
    assert result.series.live == pytest.approx([v / 100 for v in live])
    assert result.occupancy_mean == pytest.approx(sum(live) / 1000)
    assert result.occupancy_peak == pytest.approx(0.30)
    assert result.occupancy_loaded_mean == pytest.approx(sum(live[:6]) / 600)  # while C waited
    assert result.unfilled_mean == pytest.approx(sum(r - v for r, v in zip(reserved, live)) / 1000)
    assert result.never_used_mean == pytest.approx(sum(r - f for r, f in zip(reserved, final)) / 1000)
    assert result.free_mean == pytest.approx(sum(100 - r for r in reserved) / 1000)
    assert result.external_fragmentation_mean == pytest.approx(6 * 0.20 / 10)
    assert result.num_seqs_mean == pytest.approx((6 * 2 + 4) / 10)
    assert (result.num_decode_tokens, result.num_prefill_tokens, result.num_generated_tokens) == (13, 40, 13)
    assert result.num_preemptions == 0


def test_contiguous_reservation_rules_and_window() -> None:
    request = Request(0, 10, 5)
    workload = Workload((request,), max_model_len=40)
    rules = {
        policy: ContiguousEngine(workload, Budget(100), policy=policy).reservation(request)
        for policy in ("contiguous", "contiguous-pow2", "contiguous-oracle")
    }
    assert rules == {"contiguous": 40, "contiguous-pow2": 16, "contiguous-oracle": 15}
    # A window of 12: the slab is 12 slots, live tokens stop growing at 12.
    result = ContiguousEngine(workload, Budget(100), max_size=12, sample_every=1).run()
    assert result.series.live == pytest.approx([0.10, 0.11, 0.12, 0.12, 0.12, 0.12])
    assert result.unfilled_mean == pytest.approx((2 + 1) / 6 / 100)
    with pytest.raises(ConfigError, match="policy must be one of"):
        ContiguousEngine(workload, Budget(100), policy="buddy")


def test_contiguous_rejects_what_could_never_fit() -> None:
    workload = Workload((Request(0, 10, 5, n=3), Request(1, 5, 5)), max_model_len=40)
    result = ContiguousEngine(workload, Budget(100)).run()  # 3 x 40 > 100
    assert (result.num_rejected, result.num_finished) == (1, 1)


def test_first_fit_coalesces_holes() -> None:
    space = FirstFit(10)
    starts = [space.allocate(3), space.allocate(3), space.allocate(3)]
    assert starts == [0, 3, 6] and space.holes == [(9, 1)]
    space.free(3, 3)  # ...|___|...|_
    assert space.holes == [(3, 3), (9, 1)] and space.allocate(4) is None
    assert space.free_in_holes_smaller_than(4) == 4 and space.largest_hole() == 3
    space.free(6, 3)  # merges with both neighbours' holes
    assert space.holes == [(3, 7)] and space.num_free == 7
    space.free(0, 3)
    assert space.holes == [(0, 10)]


# ------------------------------------------------------------ reports


def test_same_seed_same_report_and_timing_kept_apart() -> None:
    def run(seed: int) -> dict[str, Any]:
        workload = synthetic("alpaca", 30, seed=seed, n=2, sampling="beam", num_prefix_groups=1, prefix_len=8)
        config = SimConfig(Budget(512), block_size=4, enable_prefix_caching=True, seed=seed)
        return simulate(workload, config, ["paged", "contiguous"]).as_dict()

    first, again, other = run(5), run(5), run(6)
    assert set(first["timing"]["paged"]) == {
        "wall_s",
        "simulated_tokens_per_s",
        "cpu_s",
        "simulated_tokens_per_cpu_s",
    }
    for data in (first, again, other):
        del data["timing"]
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert first != other
    assert "wall_s" not in first["policies"]["paged"] and "cpu_s" not in first["policies"]["paged"]


def test_paged_beats_contiguous_and_sharing_is_measured() -> None:
    workload = synthetic("alpaca", 40, seed=1, n=2, num_prefix_groups=1, prefix_len=16, max_model_len=256)
    config = SimConfig(Budget(1024), block_size=8, enable_prefix_caching=True)
    report = simulate(workload, config, ["paged", "contiguous", "contiguous-oracle"])
    paged, contiguous = report.results["paged"], report.results["contiguous"]
    assert paged.occupancy_loaded_mean > 0.8 > report.results["contiguous-oracle"].occupancy_loaded_mean
    assert paged.occupancy_mean > contiguous.occupancy_mean
    assert paged.num_steps < contiguous.num_steps
    assert paged.prefix_hit_rate > 0.2 and paged.blocks_saved_mean > 0 and paged.sharing_saving_mean > 0
    text = format_report(report)
    for fragment in (
        "paged",
        "contiguous-oracle",
        "memory holding live tokens, mean",
        "prefix cache hit rate",
    ):
        assert fragment in text


def test_sweep_block_sizes_and_windows() -> None:
    workload = synthetic("alpaca", 20, seed=0, num_prefix_groups=1, prefix_len=12)
    config = SimConfig(Budget(1024), enable_prefix_caching=True)
    rows = sweep(workload, config, [1, 4, 64], [None, 32])
    assert [(row.block_size, row.max_size) for row in rows] == [
        (1, None),
        (4, None),
        (64, None),
        (0, None),
        (1, 32),
        (4, 32),
        (64, 32),
        (0, 32),
    ]
    by_size = {row.block_size: row.result for row in rows if row.max_size is None}
    assert by_size[1].waste_of_used_mean < by_size[64].waste_of_used_mean
    assert by_size[4].prefix_hit_rate > 0 == by_size[64].prefix_hit_rate  # 12 shared tokens < one block of 64
    assert by_size[0].policy == "contiguous"
    table = format_sweep(rows)
    assert table.splitlines()[0].startswith("block_size") and "contiguous" in table
    assert rows[0].as_dict()["block_size"] == 1


def test_run_policy_for_every_policy_name_and_progress_goes_to_its_stream() -> None:
    workload = synthetic("alpaca", 5, seed=0, max_model_len=128)
    stream = io.StringIO()
    config = SimConfig(Budget(256), block_size=4)
    for policy in ("paged", "contiguous", "contiguous-pow2", "contiguous-oracle"):
        result = run_policy(
            policy, workload, config, progress=lambda label, total: Progress(label, total, stream=stream)
        )
        assert result.policy == policy and result.num_finished == 5
    assert "5/5 requests" in stream.getvalue() and "contiguous-pow2" in stream.getvalue()


def test_results_round_trip_through_dataclasses() -> None:
    result = run_policy("paged", synthetic("alpaca", 3, seed=0), SimConfig(Budget(256), block_size=4))
    copy = dataclasses.replace(result, wall_s=123.0)
    assert copy == result  # wall-clock fields do not take part in equality
    assert copy.timing()["wall_s"] == 123.0
