"""Expert parallelism (engine/parallel.py) on CPU: real 2-rank torchrun runs over gloo.

One torchrun launch (tests/ep_worker.py) runs both backends on both ranks: sequence logits, greedy generation
of two prompts at batch sizes 1..8, a mixed-prompt batch, a packed-expert checkpoint, a checkpoint whose
expert count the world size does not divide, and the ``python -m evident.engine.generate`` CLI. The test process
compares that with the single-device engine and with HF ``generate`` on the same tiny random DeepSeek-V2. The same
launch also runs the group routings (DeepSeek-V2's group_limited_greedy, DeepSeek-V3's noaux_tc) on two tiny
checkpoints of tests/test_engine_parity.py, one prompt, B=1 and one batch, torch path and graph step.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from test_engine_parity import CONFIGS  # noqa: E402
from test_engine_parity import PROMPT as GROUP_PROMPT
from test_engine_parity import hf_generate as parity_generate  # noqa: E402
from test_engine_parity import hf_model as parity_model
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

from evident.engine.checkpoint import CheckpointError, load_model  # noqa: E402
from evident.engine.generate import generate  # noqa: E402
from evident.engine.model import MoE  # noqa: E402
from evident.engine.parallel import ExpertParallel, init_from_env  # noqa: E402
from evident.workflow.plan.targets import free_port  # noqa: E402  (below the OS's ephemeral range, each port once)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ep_worker.py"
WORLD = 2
N_NEW = 16
BATCHES = [1, 2, 5, 8]  # one row, a pair, an odd count, the largest: each rank's rows are the batch's, at every size
PROMPTS = [[17, 200, 3, 99, 45, 128, 7, 250, 311], [5, 480, 61, 2, 64]]
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              initializer_range=0.08, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
MOE_LAYERS = [1, 2]
# 8 experts in 4 groups, 2 kept, top-3: the groups matter (k > topk_group); 4 experts a rank
GROUP = ["v2group-q_direct-e8-g4-t2-k3-yarn4", "v3-q_lora-e8-g4-t2-k3-interleave"]
GROUP_NEW, GROUP_BATCH = 5, 2


def hf_model(**overrides) -> DeepseekV2ForCausalLM:
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(DeepseekV2Config(**{**CONFIG, **overrides})).eval()


def hf_generate(model, prompt: list[int], n: int = N_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None  # never stop early (a None kwarg would not override the config's eos 2)
    gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 0, False, n
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)[0, len(prompt):].tolist()
    assert len(out) == n
    return out


# The limit is for a hung collective, not a busy machine: the module's fixture, this launch with it, took 130 s beside
# the other worker on two cores, and a third busy process there took the launch past the 180 s it had (2026-12-03)
def torchrun(nproc: int, *args: str, timeout: int = 360) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [str(exe), "--nproc_per_node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *args]
    # own session: on a timeout (a hung collective) the workers are killed with torchrun, not orphaned
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode})\n{out}\n{err}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Checkpoints, single-device and HF references, and the per-rank results of one 2-rank torchrun launch."""
    tmp = tmp_path_factory.mktemp("ep")
    hf = hf_model()
    ckpt, packed, odd = tmp / "ckpt", tmp / "packed", tmp / "odd"
    hf.save_pretrained(ckpt)  # per-expert tensor names
    packed.mkdir()
    hf.config.to_json_file(packed / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, packed / "model.safetensors")
    hf_model(n_routed_experts=3).save_pretrained(odd)
    group = {name: parity_model(CONFIGS[name]) for name in GROUP}
    for name, model in group.items():
        model.save_pretrained(tmp / name)
    out = tmp / "out"
    out.mkdir()
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"ckpt": str(ckpt), "packed_ckpt": str(packed), "odd_ckpt": str(odd),
                                "prompts": PROMPTS, "n_new": N_NEW, "batches": BATCHES, "out": str(out),
                                "group": {"ckpts": {name: str(tmp / name) for name in GROUP}, "prompt": GROUP_PROMPT,
                                          "n_new": GROUP_NEW, "batch": GROUP_BATCH}}))
    proc = torchrun(WORLD, str(WORKER), str(spec))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    single = load_model(ckpt)
    group_single = {name: load_model(tmp / name) for name in GROUP}
    return {"hf": hf, "ckpt": str(ckpt), "single": single, "ranks": ranks, "proc": proc,
            "hf_tokens": [hf_generate(hf, p) for p in PROMPTS],
            "single_tokens": [generate(single, [p], N_NEW).tokens[0] for p in PROMPTS],
            "group_single": group_single,
            "group_hf_tokens": {n: parity_generate(m, GROUP_PROMPT, GROUP_NEW) for n, m in group.items()},
            "group_single_tokens": {n: generate(m, [GROUP_PROMPT], GROUP_NEW).tokens[0]
                                    for n, m in group_single.items()}}


def _load_worker():
    spec = importlib.util.spec_from_file_location("ep_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sequence_logits = _load_worker().sequence_logits  # the worker's own procedure, run single-device


def single_logits(run, pi: int) -> torch.Tensor:
    return sequence_logits(run["single"], PROMPTS[pi], run["single_tokens"][pi])


# ---------------------------------------------------------------------------------------------
# 2 ranks, both backends
# ---------------------------------------------------------------------------------------------
def test_single_engine_matches_hf(run):
    assert run["single_tokens"] == run["hf_tokens"]
    assert len(set(map(tuple, run["hf_tokens"]))) == len(PROMPTS)


@pytest.mark.parametrize("backend", ["host-staged", "collective"])
def test_generation_matches_single_and_hf(run, backend):
    for rank, res in enumerate(run["ranks"]):
        r = res["backends"][backend]
        assert r["describe"] == {"rank": rank, "world_size": WORLD, "backend": backend, "device": "cpu",
                                 "collective_backend": "gloo"}
        for pi in range(len(PROMPTS)):
            ref = run["hf_tokens"][pi]
            for b in BATCHES:
                assert r["gen"][f"{pi}-b{b}"] == [ref] * b, f"{backend} rank {rank} prompt {pi} batch {b}"
        assert r["mixed"] == run["hf_tokens"]


@pytest.mark.parametrize("backend", ["host-staged", "collective"])
def test_graph_step_under_expert_parallelism_matches_hf(run, backend):
    """Each rank stacks its own experts (the shared one on rank 0 only) and combines fp32 partials."""
    for rank, res in enumerate(run["ranks"]):
        assert res["backends"][backend]["graph"] == [t[:N_NEW // 2] for t in run["hf_tokens"]], f"{backend} rank {rank}"


def test_logits_host_staged_equals_collective_bitwise(run):
    """Both backends, both ranks: the same bits (an fp32 sum of two partials commutes). Against the single
    device engine: < 1e-5; in fact bitwise at the workers' thread count (OMP_NUM_THREADS=1), because with top-2
    over 2 ranks each token's two expert outputs are added once either way (0 + a + b == a + b == (a + 0) + b)."""
    threads = torch.get_num_threads()
    for pi in range(len(PROMPTS)):
        ref = single_logits(run, pi)
        torch.set_num_threads(1)
        try:
            ref1 = single_logits(run, pi)
        finally:
            torch.set_num_threads(threads)
        got = [res["backends"][b]["logits"][pi] for res in run["ranks"] for b in ("host-staged", "collective")]
        for g in got:
            assert torch.equal(g, got[0]), "every rank and both backends: the same bits"
        diff = (got[0] - ref).abs().max().item()
        print(f"\nprompt {pi}: {tuple(ref.shape)} logits, EP vs single-device max abs diff {diff:.3g} "
              f"({threads} threads), {(got[0] - ref1).abs().max().item():.3g} (1 thread)")
        assert diff < 1e-5
        assert torch.equal(got[0], ref1)
    m = [res["backends"][b]["margins"] for res in run["ranks"] for b in ("host-staged", "collective")]
    assert all(x == m[0] for x in m)


@pytest.mark.parametrize("name", GROUP)
def test_group_routings_under_expert_parallelism(run, name):
    """V2 group-limited and V3 noaux_tc, 4 of 8 experts a rank: both ranks and both backends generate HF's
    tokens (torch path at B=1 and at a batch, graph step at the batch), as the single-device engine does, and the
    graph step with the torch path's margins (the groups change most rows' experts here, but not V3's first 5
    tokens). The sequence logits are the same bits on every rank and backend, and the single-device ones to < 1e-5
    (not bitwise: with top-3 over 2 ranks a rank may hold the later two of a token's experts, a + (b + c))."""
    want = run["group_hf_tokens"][name]
    assert run["group_single_tokens"][name] == want
    got = []
    for rank, res in enumerate(run["ranks"]):
        for backend in ("host-staged", "collective"):
            g = res["backends"][backend]["group"][name]
            shard = list(range(rank * 4, rank * 4 + 4))
            assert g["experts"] == {i: shard for i in g["experts"]} and g["experts"], (backend, rank)
            assert g["tokens"] == want, f"{backend} rank {rank} B=1"
            assert g["batch"] == [want] * GROUP_BATCH, f"{backend} rank {rank} B={GROUP_BATCH}"
            assert g["graph"] == [want] * GROUP_BATCH, f"{backend} rank {rank} graph step B={GROUP_BATCH}"
            # the graph step's own router (kernels/route.py) routes as MoE.route: top1-top2 margins to rounding
            for m in g["graph_margins"]:
                assert m == pytest.approx(g["margins"], abs=1e-4), f"{backend} rank {rank} graph step margins"
            got.append(g)
    for g in got:
        assert torch.equal(g["logits"], got[0]["logits"]), "every rank and both backends: the same bits"
        assert g["margins"] == got[0]["margins"]
    ref = sequence_logits(run["group_single"][name], GROUP_PROMPT, want)
    diff = (got[0]["logits"] - ref).abs().max().item()
    print(f"\n{name}: {tuple(ref.shape)} logits, EP vs single-device max abs diff {diff:.3g}")
    assert diff < 1e-5


def test_each_rank_holds_only_its_shard(run):
    single = run["single"]
    moe = [layer.mlp for layer in single.layers if isinstance(layer.mlp, MoE)]
    per_expert = sum(p.numel() for p in moe[0].experts["0"].parameters())
    total = sum(p.numel() for p in single.parameters())
    shard = 8 // WORLD
    for rank, res in enumerate(run["ranks"]):
        for backend, r in res["backends"].items():
            want = list(range(rank * shard, (rank + 1) * shard))
            assert r["experts"] == {i: want for i in MOE_LAYERS}, (backend, rank)
            assert r["n_expert_modules"] == shard * len(MOE_LAYERS)
            assert r["n_expert_params"] == per_expert * shard * len(MOE_LAYERS)
            assert r["n_params"] == total - per_expert * (8 - shard) * len(MOE_LAYERS)
            assert r["n_state_tensors"] == len(single.state_dict()) - 3 * (8 - shard) * len(MOE_LAYERS)
        assert res["backends"]["host-staged"]["packed_experts"] == {i: want for i in MOE_LAYERS}


def test_packed_expert_checkpoint_under_ep(run):
    for res in run["ranks"]:
        hs = res["backends"]["host-staged"]
        assert torch.equal(hs["packed_logits"], hs["logits"][0])


def test_world_size_must_divide_experts(run):
    for res in run["ranks"]:
        err = res["backends"]["host-staged"]["odd_error"]
        assert err is not None and err.startswith("ValueError")
        assert "world_size=2" in err and "n_routed_experts=3" in err


@pytest.mark.parametrize("backend", ["host-staged", "collective"])
def test_cli_under_torchrun_rank0_prints(run, backend):
    """``python -m evident.engine.generate --backend ...`` (its main(), run by the worker on every rank)."""
    want = "".join(",".join(map(str, t)) + "\n" for t in run["hf_tokens"])
    assert run["ranks"][0]["backends"][backend]["cli_stdout"] == want
    assert run["ranks"][1]["backends"][backend]["cli_stdout"] == ""


# ---------------------------------------------------------------------------------------------
# in-process: sharding arithmetic, errors, loading a shard (no process group needed)
# ---------------------------------------------------------------------------------------------
def test_experts_shard_ranges_and_errors():
    assert ExpertParallel(0, 2, "collective").experts(8) == range(0, 4)
    assert ExpertParallel(1, 2, "host-staged").experts(8) == range(4, 8)
    assert ExpertParallel(3, 4, "collective").experts(64) == range(48, 64)
    with pytest.raises(ValueError, match=r"world_size=3 does not divide n_routed_experts=8"):
        ExpertParallel(0, 3, "collective").experts(8)
    with pytest.raises(ValueError, match="host-staged, collective"):
        ExpertParallel(0, 2, "allgather")
    ep = ExpertParallel(0, 2, "collective", "cpu")
    assert ep.collective_backend == "gloo" and ep.device == torch.device("cpu")


def test_init_from_env_needs_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE.*torchrun --nproc_per_node N"):
        init_from_env("host-staged", "cpu")
    with pytest.raises(ValueError, match="backend"):
        init_from_env("single", "cpu")


def test_cli_without_torchrun_is_a_usage_error(run, monkeypatch, capsys):
    from evident.engine.generate import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", run["ckpt"], "--prompt-ids", "1,2,3", "--backend", "collective"])
    assert e.value.code == 2 and "torchrun --nproc_per_node N" in capsys.readouterr().err


def test_load_shard_in_process(run, tmp_path):
    """Loading needs no process group: rank 1 of 2 gets experts 4..7; the whole file is still validated."""
    ep = ExpertParallel(1, 2, "host-staged", "cpu")
    model = load_model(run["ckpt"], ep=ep)
    for i in MOE_LAYERS:
        experts = model.layers[i].mlp.experts
        assert list(experts) == ["4", "5", "6", "7"]
        ref = run["single"].layers[i].mlp.experts["5"].down_proj.weight
        assert torch.equal(experts["5"].down_proj.weight, ref)
    assert torch.equal(model.layers[1].mlp.shared_experts.up_proj.weight,
                       run["single"].layers[1].mlp.shared_experts.up_proj.weight)
    # another rank's expert tensors are not read but still checked: missing or misshapen is an error
    from safetensors.torch import load_file

    sd = load_file(os.path.join(run["ckpt"], "model.safetensors"))
    missing = tmp_path / "missing"
    missing.mkdir()
    run["hf"].config.to_json_file(missing / "config.json")
    save_file({k: v for k, v in sd.items() if k != "model.layers.2.mlp.experts.1.up_proj.weight"},
              missing / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.1\.up_proj"):
        load_model(missing, ep=ep)
    bad = tmp_path / "bad"
    bad.mkdir()
    run["hf"].config.to_json_file(bad / "config.json")
    save_file({**sd, "model.layers.2.mlp.experts.0.down_proj.weight": torch.ones(3, 3)}, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight' has shape \(3, 3\)"):
        load_model(bad, ep=ep)


def test_world_size_one_is_single_device_bitwise(run):
    """One rank: an fp32 partial and a no-op combine give the single-device fp32 logits exactly."""
    model = load_model(run["ckpt"], ep=ExpertParallel(0, 1, "collective", "cpu"))
    assert all(len(model.layers[i].mlp.experts) == 8 for i in MOE_LAYERS)
    assert torch.equal(single_logits({**run, "single": model}, 0), single_logits(run, 0))


CAPTURED_COLLECTIVE = """
import torch, torch.distributed as dist
from evident.engine.parallel import init_from_env
ep = init_from_env("collective", "cuda")
x = torch.full((4,), 2.0, device=ep.device)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    dist.all_reduce(x)  # the communicator's first use, outside the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    dist.all_reduce(x)
    x.mul_(0.5)
graph.replay()
torch.cuda.synchronize()
assert x.tolist() == [float(ep.world_size ** 2)] * 4, x  # 2 -> 2W (eager) -> 2W*W -> W*W (replay)
ep.before_close(graph.reset)
ep.close()
print("closed", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
def test_a_graph_captured_collective_then_close_does_not_hang(tmp_path):
    """An NCCL all_reduce captured in a CUDA graph and replayed; close() frees the graph first (its before_close
    hook), then destroys the group, and the process exits (pytorch#115388: it hangs if the graph outlives it)."""
    script = tmp_path / "captured.py"
    script.write_text(CAPTURED_COLLECTIVE)
    proc = torchrun(torch.cuda.device_count(), str(script), timeout=120)
    assert proc.stdout.count("closed") == torch.cuda.device_count()
