"""The bench's distinct-prompts contract (bench.prompts): its cells beside the same-prompt ones, each row checked
against its prompt alone, and the floor from the experts actually chosen (workflow/bench/replay.py, workflow/bench/floor.py);
the contracts kept apart by diff, trend and the baseline."""

from __future__ import annotations

import contextlib

import handbuilt as hb
import mutants
import pytest
import tinyev
import torch

from evident.engine.config import load_args
from evident.workflow.archive import archive, diff, trend
from evident.workflow.bench import floor, replay
from evident.workflow.core.evidence import read_json, write_json
from evident.workflow.plan import environment
from evident.workflow.plan.runs import DISTINCT
from evident.workflow.stages import bench
from evident.workflow.stages.bench_report import compare_to

PROMPTS = ["Hi", "The cat sat on a long mat today", "7 + 5 =", "Hello, evident! The engine says"]  # mixed lengths
NEW = 6


def make(root, dtype="float32", **over):
    cfg = tinyev.config(dtype=dtype, bench={"backends": ["single"], "batch_sizes": [1, 4], "prompt": "Hi there", "prompts": PROMPTS,
                               "new_tokens": NEW, "warmup": 0, "repeats": 1, **over})
    ckpt, ev = tinyev.make(root, cfg)
    write_json(ev / "env.json", environment.describe("cpu"))  # the context stage's, which the cells cite
    return ckpt, ev


def run_bench(ckpt, ev, backend="single"):
    bench.main(["--checkpoint", str(ckpt), "--evidence", str(ev), "--backend", backend, "--batch-sizes", "1,4"])


@pytest.fixture(scope="module")
def benched(tmp_path_factory):
    ckpt, ev = make(tmp_path_factory.mktemp("prompts"))
    run_bench(ckpt, ev)
    return ckpt, ev


def batched_choices(ckpt, rows: list[list[int]]) -> dict[int, list[set[int]]]:
    """Independently of the replay: the experts each MoE layer chose across the rows of the batched generate itself,
    per decode step (generate's `around` numbers the steps; hooks on the MoE layers re-run their router)."""
    from evident.engine.checkpoint import load_model
    from evident.engine.generate import generate
    from evident.engine.model import MoE

    model = load_model(ckpt)
    step, chosen = [0], {}

    def hook(module, args, out):
        if step[0] >= 2:
            ids = module.route(args[0].reshape(-1, args[0].shape[-1]))[1]
            chosen.setdefault(step[0], []).append(set(ids.flatten().tolist()))

    @contextlib.contextmanager
    def around(s, total):
        step[0] = s
        yield

    handles = [layer.mlp.register_forward_hook(hook) for layer in model.layers if isinstance(layer.mlp, MoE)]
    generate(model, rows, NEW, around=around)
    for h in handles:
        h.remove()
    return chosen


def test_distinct_prompts_floor_counts_the_experts_the_batch_chose(benched):
    ckpt, ev = benched
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    rows = [tok.encode(p).ids for p in PROMPTS]
    assert len({len(r) for r in rows}) == 4  # mixed lengths
    cell, same = read_json(ev / "bench/single-distinct-b4.json"), read_json(ev / "bench/single-b4.json")
    assert cell["contract"]["prompts"] == DISTINCT and cell["contract"]["prompt_tokens"] == [len(r) for r in rows]
    assert "prompts" not in same["contract"]  # the same-prompt contract keeps its keys: comparable with older cells
    assert cell["rows_check"]["verdict"] == replay.AS_ALONE and same["rows_check"]["verdict"] == "rows_identical"
    chosen = batched_choices(ckpt, rows)
    lay = floor.layout(ckpt, torch.float32)
    assert any(len(ids) > lay.top_k for layers in chosen.values() for ids in layers)  # these rows route apart
    want = [lay.step([len(r) + s - 1 for r in rows], chosen[s])["total"] for s in range(3, NEW + 1)]
    fl = cell["floor"]
    assert fl["step_bytes"] == want and fl["steps"] == NEW - 2
    assert fl["unique_experts"]["max"] > lay.top_k and fl["unique_experts"]["min"] >= lay.top_k
    assert fl["bytes"]["chosen_experts"] > same["floor"]["bytes"]["chosen_experts"]
    assert fl["floor_fraction"] == pytest.approx(fl["floor_ms"] / cell["stats"]["tpot"]["p50"])


def test_same_prompt_floor_is_the_top_k_floor(benched):
    """Identical rows choose top_k experts a layer: the routed floor of a same-prompt cell is step_bytes'."""
    ckpt, ev = benched
    cell = read_json(ev / "bench/single-b4.json")
    n = cell["contract"]["prompt_tokens"]
    assert cell["floor"]["step_bytes"] == [floor.step_bytes(ckpt, torch.float32, 4, n + s - 1)["total"]
                                           for s in range(3, NEW + 1)]
    top_k = floor.layout(ckpt, torch.float32).top_k
    assert cell["floor"]["unique_experts"]["min"] == cell["floor"]["unique_experts"]["max"] == top_k


def test_the_prefill_floor_counts_the_prompts_chosen_experts_and_the_rate_that_binds(benched):
    """Each cell's prefill floor (workflow/bench/floor.py prefill_floor) beside its TTFT: the union of the experts its
    rows' prompts chose, by hand on a Layout, bytes- or FLOP-bound as the rates say."""
    ckpt, ev = benched
    cell, same = read_json(ev / "bench/single-distinct-b4.json"), read_json(ev / "bench/single-b4.json")
    pf, top_k = cell["prefill_floor"], floor.layout(ckpt, torch.float32).top_k
    assert pf["prompt_tokens"] == sum(cell["contract"]["prompt_tokens"]) and pf["rows"] == 4
    assert pf["floor_ms"] == max(pf["bytes_ms"], pf["flops_ms"]) > 0
    assert pf["ttft_over_floor"] == pytest.approx(cell["stats"]["ttft"]["p50"] / pf["floor_ms"])
    assert pf["unique_experts"]["min"] >= top_k
    assert pf["bytes"]["chosen_experts"] >= same["prefill_floor"]["bytes"]["chosen_experts"]
    lay = floor.Layout(weights=1000, per_row=0, row=10, expert=[100, 100], top_k=2, n_experts=8,
                       cache_row=lambda p: 3 * p, head=200, itemsize=2, attention=4)
    prompts, experts = [[5, 6, 7], [5, 8]], [{0, 1, 2}, {3}]
    fl = floor.prefill_floor(lay, prompts, experts, bandwidth=1e3, flop_rate=1e4, ttft_p50_ms=2910.0)
    # weights, 4 experts, 4 distinct tokens' rows, the cache of 3 + 2 positions
    assert fl["bytes"] == {"weights": 1000, "chosen_experts": 400, "embedding_rows": 40, "cache": 15, "total": 1455}
    # 5 tokens x 2 x (400 dense + 2 x 100 routed parameters), the head (100) at 2 rows, 4 x (6 + 3) causal pairs
    assert fl["flops"] == 6000 + 400 + 36
    assert (fl["bound"], fl["floor_ms"], fl["ttft_over_floor"]) == ("bytes", 1455.0, 2.0)
    slow = floor.prefill_floor(lay, prompts, experts, bandwidth=1e3, flop_rate=1e3, ttft_p50_ms=1.0)
    assert (slow["bound"], slow["floor_ms"]) == ("flops", 6436.0)


def test_the_busiest_rank_reads_its_own_shard_of_the_chosen_experts():
    lay = floor.Layout(weights=1000, per_row=0, row=10, expert=[100, 100], top_k=2, n_experts=8,
                       cache_row=lambda p: p)
    experts = [{0, 1, 2, 5}, {6, 7}]  # rank 0 holds 0-3, rank 1 4-7
    assert lay.step([3, 4], experts)["chosen_experts"] == 600
    assert lay.step([3, 4], experts, ranks=2)["chosen_experts"] == 300  # rank 0: 3 experts, rank 1: 3
    assert lay.step([3, 4], [{0, 1, 2, 3}, {0}], ranks=2)["chosen_experts"] == 500
    assert lay.step([3, 4])["chosen_experts"] == 400 and lay.step([3, 4])["cache"] == 7


def test_a_screened_step_counts_the_screen_in_place_of_the_vocabulary_projection(benched):
    """The graph path at batch 1 reads the vocabulary projection's int8 screen (a byte an element, 8 bytes a row), not
    its weight: the floor of such a step counts that, and says so."""
    ckpt, ev = benched
    lay = floor.layout(ckpt, torch.float32)
    args = load_args(str(ckpt))
    assert lay.head == args.vocab_size * args.hidden_size * 4 and lay.screen == args.vocab_size * (args.hidden_size + 8)
    plain, screened = lay.step([5]), lay.step([5], screened=True)
    assert plain["weights"] - screened["weights"] == lay.head - lay.screen > 0
    assert plain["total"] - screened["total"] == lay.head - lay.screen
    fl = floor.bench_floor(lay, [([5], [{0, 1}] * len(lay.expert))], 1e9, 1.0, screened=True)
    assert fl["vocabulary_screened"] and "screen" in fl["basis"]
    cell = read_json(ev / "bench/single-b1.json")  # the torch path: no screen
    assert cell["floor"]["vocabulary_screened"] is False
    from evident.workflow.archive import summary

    assert "int8 screen" not in summary.bench_floor_lines([cell])[0]
    assert "int8 screen" in summary.bench_floor_lines([cell, {"floor": fl}])[0]


def test_a_batch_that_mixes_rows_writes_no_distinct_figure(tmp_path, monkeypatch):
    """An injected bug: each batched decode step feeds every row the last token of the next row. Same-prompt rows
    are identical, so their cells cannot see it; the distinct-prompts rows check does, and no figure is written."""
    import evident.engine.generate as g

    decode = g._decode

    def mixed(model, cache, last, rows, index):
        return decode(model, cache, last.roll(-1) if len(last) > 1 else last, rows, index)

    monkeypatch.setattr(g, "_decode", mixed)
    ckpt, ev = make(tmp_path)
    with pytest.raises(SystemExit, match="distinct prompts: row .* where its prompt alone picks .*no figure is"):
        run_bench(ckpt, ev)
    assert (ev / "bench/single-b4.json").is_file() and (ev / "bench/single-distinct-b1.json").is_file()
    assert not (ev / "bench/single-distinct-b4.json").exists()
    assert read_json(ev / "stages/bench-single.json")["status"] == "failed"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_that_counts_padding_writes_no_distinct_figure(tmp_path, monkeypatch, dtype):
    """An injected bug of the batched prefill (tests/mutants.py `prefill_counts_padding`): a ragged row's padding
    counted in its length, so that its decode attends to the padding's cache entries. Same-prompt rows have no
    padding, so their cells cannot see it; the distinct-prompts rows check does, and no figure is written."""
    from evident.engine.model import Transformer

    clean = make(tmp_path / "clean", dtype)
    run_bench(*clean)
    assert read_json(clean[1] / "bench/single-distinct-b4.json")["rows_check"]["verdict"] != replay.MISMATCH
    monkeypatch.setattr(Transformer, "forward", mutants.mutated_module("prefill_counts_padding").Transformer.forward)
    ckpt, ev = make(tmp_path / "mutant", dtype)
    with pytest.raises(SystemExit, match="distinct prompts: row .* where its prompt alone picks .*no figure is"):
        run_bench(ckpt, ev)
    assert (ev / "bench/single-b4.json").is_file() and not (ev / "bench/single-distinct-b4.json").exists()


def test_transformers_routers_choose_as_the_engine_does(benched):
    """The hf paths' floor comes from transformers' own routers (float32: the same choices as the engine's)."""
    from evident.engine.checkpoint import load_model
    from evident.workflow.models import hf

    ckpt, _ = benched
    rows, tokens = [[5, 9, 2], [7, 7, 3, 11, 4]], [[3, 8, 1, 4], [2, 2, 9, 6]]
    _, model = hf.load(ckpt, "float32", "cpu")
    got = replay.replay(model, rows, tokens, hf=True)
    want = replay.replay(load_model(ckpt), rows, tokens)
    assert [[[sorted(ids) for ids in step] for step in r.experts] for r in got] \
        == [[[sorted(ids) for ids in step] for step in r.experts] for r in want]
    assert len(got[0].experts) == 3 and all(len(ids) == 2 for ids in got[0].experts[0])  # N - 1 steps, top_k ids


def test_contracts_are_kept_apart_by_diff_trend_and_the_baseline(tmp_path):
    def distinct(c):
        c["contract"] = {**c["contract"], "prompts": DISTINCT, "prompt_tokens": [9, 4, 7, 12]}
        return c

    root = tmp_path / "evidence"
    a = hb.build(root, "tiny", "aaaaaaa-c1-r1", plot=False, created="2026-01-01T00:00:00Z",
                 cells=[hb.cell("single", 4, 10.0), distinct(hb.cell("single", 4, 20.0))])
    b = hb.build(root, "tiny", "bbbbbbb-c1-r1", plot=False, created="2026-01-02T00:00:00Z",
                 cells=[hb.cell("single", 4, 8.0), distinct(hb.cell("single", 4, 30.0))])
    assert {p.name for p in (b / "bench").glob("*-b*.json")} == {"single-b4.json", "single-distinct-b4.json"}
    rows = {c["cell"]: c for c in diff.bench_diff(archive.load(a), archive.load(b))}
    assert set(rows) == {"single-b4", "single-distinct-b4"}
    assert rows["single-b4"]["claim"] == "faster" and rows["single-b4"]["tpot_p50_ratio"] == pytest.approx(0.8)
    assert rows["single-distinct-b4"]["claim"] == "slower" and rows["single-distinct-b4"]["prompts"] == DISTINCT
    frame = trend.history(trend.directories(root, "tiny")[0])
    assert sorted(set(frame["cell"])) == ["single-b4", "single-distinct-b4"]
    assert frame.set_index(["evidence", "cell"]).loc[("bbbbbbb-c1-r1", "single-distinct-b4"), "regression"]
    claims = {(c["prompts"], c["claim"]) for c in compare_to([read_json(b / "bench/single-distinct-b4.json")], a)}
    assert claims == {(DISTINCT, "slower")}

    # a distinct cell in B only: no comparison with A's same-prompt cell of that backend and batch
    (a / "bench/single-distinct-b4.json").unlink()
    rows = {c["cell"]: c for c in diff.bench_diff(archive.load(a), archive.load(b))}
    assert rows["single-distinct-b4"]["reason"] == "only in B" and rows["single-distinct-b4"]["tpot_p50_ratio"] is None
    out = compare_to([read_json(b / "bench/single-distinct-b4.json")], a)
    assert out[0]["claim"] == "no directional claim" and "no single-distinct-b4 cell" in out[0]["reason"]


def test_summary_names_each_figures_contract_with_its_floor_beside_it(benched):
    from evident.workflow.archive import summary
    from evident.workflow.stages import bench_report

    _, ev = benched
    cells = sorted((ev / "bench").glob("single*-b*.json"))
    bench_report.main(["--evidence", str(ev), *map(str, cells)])
    text = "\n".join(summary.bench_section(ev))
    decode, prefill = text.split("Prefill floor (TTFT p50 against it)")  # the decode step's table, then the prefill's
    rows = lambda part: [[c.strip() for c in line.strip("|").split("|")]  # noqa: E731
                         for line in part.splitlines() if line.startswith("| single")]
    table = rows(decode)
    assert [(r[1], r[2]) for r in table] == [("same", "1"), ("same", "4"), ("distinct", "1"), ("distinct", "4")]
    for row in rows(prefill):  # each cell's TTFT p50 against its own prefill floor
        fl = read_json(ev / f"bench/single{'-distinct' if row[1] == 'distinct' else ''}-b{row[2]}.json")["prefill_floor"]
        assert row[4:8] == [f"{fl['ttft_p50_ms']:.3f}", f"{fl['floor_ms']:.3f}", fl["bound"], f"{fl['ttft_over_floor']:.1f}x"]
    assert len(rows(prefill)) == 4
    for row in table:
        cell = read_json(ev / f"bench/single{'-distinct' if row[1] == 'distinct' else ''}-b{row[2]}.json")
        fl = cell["floor"]
        assert row[7:10] == [f"{fl['floor_ms']:.3f}", f"{100 * fl['floor_fraction']:.0f}%",
                             f"{fl['unique_experts']['mean']:.1f} ({fl['unique_experts']['min']}–"
                             f"{fl['unique_experts']['max']})"]
    assert "- `same`: one prompt (`bench.prompt`" in text
    assert "- `distinct`: row r the prompt `bench.prompts[r]`" in text
    assert "`rows_as_alone` single-b1, single-b4" in text
    assert "Floor: per steady decode step" in text and "of 8 routed experts, top-2 a row" in text


def test_a_difference_is_a_defect_only_where_both_computations_were_sure():
    """Rounding moves both computations of a row by err: they can differ where either was within err of a tie, never
    where both preferred their own pick by more than the near-tie margin."""
    row = replay.Row(experts=[], prefill=[], alone=[3, 5, 7], gaps=[0.0, 0.9, 0.0])
    tokens = [[3, 6, 7]]  # step 2: the batch picked 6, the row alone 5 (by 0.9 logits)
    check = replay.alone_check([row], tokens, "bfloat16", margins=[[2.0, 0.01, 1.0]])
    assert check["verdict"] == replay.NEAR_TIES and check["differences"] == 1 and check["rows_as_alone"] == 0
    assert check["first"] == {"row": 0, "step": 2, "token": 6, "alone_token": 5, "gap": 0.9, "batch_margin": 0.01}
    assert replay.alone_check([row], tokens, "bfloat16", margins=[[2.0, 0.6, 1.0]])["verdict"] == replay.MISMATCH
    assert replay.alone_check([row], tokens, "bfloat16")["verdict"] == replay.MISMATCH  # no margins (hf): the gap
    assert replay.alone_check([row], tokens, "bfloat16", margins=[[2.0, 0.6, 1.0]])["largest"]["gap"] == 0.9
    quiet = replay.Row(experts=[], prefill=[], alone=[3, 5, 7], gaps=[0.0, 0.3, 0.0])
    assert replay.alone_check([quiet], tokens, "bfloat16")["verdict"] == replay.NEAR_TIES
    assert replay.alone_check([quiet], tokens, "float32")["verdict"] == replay.MISMATCH
    assert replay.alone_check([quiet], [[3, 5, 7]], "float32")["verdict"] == replay.AS_ALONE


def test_the_rows_check_takes_parity_s_measured_margin(tmp_path):
    """In bf16 the rows check's margin is parity's, measured from the oracle's record: under transformers' own noise
    of 1.5 a difference of 0.9 (a row_mismatch under the floor 0.5) is a near tie, one of 1.6 still a mismatch;
    without the oracle stage the floor decides."""
    from test_compare import noisy_bf16_oracle

    write_json(tmp_path / "oracle/hf.json", noisy_bf16_oracle(1.0, {i: 0.75 for i in range(20)})[0])
    config = {"dtype": "bfloat16", "parity": {"near_tie_margin": None}}
    margin = bench.rows_margin(tmp_path, config)
    assert margin[0] == pytest.approx(1.5) and margin[1]["transformers_margin_error"] == pytest.approx(1.5)
    tokens = [[3, 6, 7]]
    row = lambda gap: replay.Row(experts=[], prefill=[], alone=[3, 5, 7], gaps=[0.0, gap, 0.0])  # noqa: E731
    check = replay.alone_check([row(0.9)], tokens, "bfloat16", near_tie=margin)
    assert check["verdict"] == replay.NEAR_TIES and check["near_tie_noise"] == margin[1]
    assert replay.alone_check([row(1.6)], tokens, "bfloat16", near_tie=margin)["verdict"] == replay.MISMATCH
    floor_only = bench.rows_margin(tmp_path / "no-oracle", config)
    assert floor_only == (0.5, None)
    assert replay.alone_check([row(0.9)], tokens, "bfloat16", near_tie=floor_only)["verdict"] == replay.MISMATCH
    fixed = bench.rows_margin(tmp_path, {**config, "parity": {"near_tie_margin": 2.0}})
    assert fixed == (2.0, None)


def test_a_router_that_returns_no_expert_ids_is_refused_by_name():
    class Router(torch.nn.Module):
        def forward(self, x):
            return x @ torch.ones(4, 3)  # logits only: no ids to count

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.gate = Router()

        def forward(self, x):
            return self.mlp.gate(x)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer()])
    with pytest.raises(replay.ReplayError, match="Router returned no expert ids"):
        with replay._routers(model, hf=True):
            model.model.layers[0](torch.ones(2, 4))
