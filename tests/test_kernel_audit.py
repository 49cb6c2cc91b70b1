"""The kernel resource audit stage: model shapes from config.json; on a CPU a skipped record with the reason
(never `ok`); on a GPU registers, spills and shared memory for every kernel."""
import json

import pytest
import torch
import yaml

from evident.workflow.core.evidence import read_json
from evident.workflow.stages import kernel_audit

CONFIG = {"hidden_size": 2048, "kv_lora_rank": 512, "num_attention_heads": 16, "v_head_dim": 128,
          "moe_intermediate_size": 1408, "intermediate_size": 10944, "q_lora_rank": None, "n_shared_experts": 2,
          "vocab_size": 102400, "n_routed_experts": 64, "num_experts_per_tok": 6}


@pytest.fixture
def dirs(tmp_path):
    ckpt, ev = tmp_path / "ckpt", tmp_path / "ev"
    ckpt.mkdir()
    ev.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (ev / "config.yaml").write_text(yaml.safe_dump({"device": device, "dtype": "bfloat16"}))
    return ckpt, ev


def test_model_shapes(dirs):
    ks, vocab = kernel_audit.model_shapes(dirs[0])
    assert ks == [512, 1408, 2048, 2816, 10944] and vocab == 102400


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_records_skipped_with_reason(dirs):
    ckpt, ev = dirs
    kernel_audit.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    record = read_json(ev / "stages/kernel_audit.json")
    assert record["status"] == "skipped" and "no CUDA device" in record["reason"]
    audit = read_json(ev / "kernels/audit.json")
    assert audit["verdict"] == "not_compiled" and audit["kernels"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
def test_gpu_audit_has_every_kernel_without_spills(dirs):
    ckpt, ev = dirs
    kernel_audit.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    audit = read_json(ev / "kernels/audit.json")
    assert {r["kernel"] for r in audit["kernels"]} == {"gemv_exact", "gemv_fused", "gemm_per_token", "pick_batch",
                                                      "head_pick", "head_screen", "head_check", "add_rms_norm",
                                                      "experts_gate_up", "experts_down", "skinny_linear"}
    assert all(r["registers"] > 0 for r in audit["kernels"])
    assert audit["verdict"] == ("spills" if any(r["spills"] for r in audit["kernels"]) else "ok")
    assert read_json(ev / "stages/kernel_audit.json")["status"] == "ok"


def test_the_vocabulary_projection_is_audited_at_the_hidden_size_alone(monkeypatch):
    """head_pick's weight is [vocab, K]: compiled at every K it would take 2.2 GB at K = 10944, a shape the step never
    launches. The launches are stood in for (the interpreter compiles nothing), so this runs on a CPU."""
    from types import SimpleNamespace

    from evident.kernels import argmax, audit, gemv, head, norm, skinny

    weights = {}

    def fake(module):
        def launch(*args, **kwargs):
            if module is head:
                weights.setdefault("head", set()).add(tuple(args[1].shape))
            compiled = SimpleNamespace(n_regs=32, n_spills=0, metadata=SimpleNamespace(shared=0, num_warps=1))
            return (compiled, compiled) if kwargs.get("screened") else compiled
        return launch

    for module in (argmax, gemv, head, norm, skinny):
        monkeypatch.setattr(module, "_launch", fake(module))
    monkeypatch.setattr(head, "_launch_screened", lambda *a: fake(head)(*a, screened=True))
    rows = audit.audit([64, 96, 160], vocab=256, hidden=96, device="cpu")
    assert [r["K"] for r in rows if r["kernel"] in ("head_pick", "head_screen", "head_check")] == [96] * 3
    assert weights["head"] == {(256, 96)}
    assert sorted(r["K"] for r in rows if r["kernel"] == "gemv_exact") == [64, 96, 160]  # the projections: every K


@pytest.mark.parametrize("verdict,fails", [("spills", True), ("ok", False), ("not_compiled", False)])
def test_gate_fails_on_spills_after_sealing(tmp_path, verdict, fails):
    from evident.workflow.core.evidence import write_json, write_manifest
    from evident.workflow.stages import gate

    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "config.yaml").write_text(yaml.safe_dump({"parity": {"require_exact": False}}))
    write_json(ev / "kernels/audit.json", {"verdict": verdict, "kernels": []})
    write_manifest(ev, {"evidence_id": "x", "verdict": "all_token_text_exact"})
    args = ["--evidence", str(ev), "--out", str(tmp_path / "gate.json")]
    if fails:
        with pytest.raises(SystemExit, match="register spills"):
            gate.main(args)
        record = read_json(tmp_path / "gate.json")  # the record of a failing run too, with why it failed
        assert record["passed"] is False and "register spills" in record["failed"][0]
    else:
        gate.main(args)
        assert read_json(tmp_path / "gate.json")["verdicts"]["audit"] == verdict
