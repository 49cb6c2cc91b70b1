"""Model families (workflow/models/families/): each family answers what the workflow asks, on the shipped model
configs (config/models/*.yaml) and small synthetic ones; an unknown model_type is refused by name; and workflow code
outside the families names none of them."""
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from evident.engine.config import args_from_hf
from evident.workflow.bench.floor import Layout
from evident.workflow.models import checkpoints, families
from evident.workflow.models.families import deepseek, deepseek_v4
from evident.workflow.plan import estimate, runs
from evident.workflow.plan.campaign import model_config, models, required_fields

ROOT = Path(__file__).resolve().parent.parent
TINY, V4_TINY = model_config("tiny"), model_config("deepseek-v4-tiny")
SHIPPED = {name: model_config(name) for name in models()}
FAMILY = {"tiny": deepseek.FAMILY, "tiny-mla576": deepseek.FAMILY, "deepseek-v2-lite": deepseek.FAMILY,
          "moonlight-16b-a3b": deepseek.FAMILY, "deepseek-v4-tiny": deepseek_v4.FAMILY,
          "deepseek-v4-flash": deepseek_v4.FAMILY}


# --- picking the family -------------------------------------------------------------------------

def test_every_shipped_model_has_its_family():
    assert set(FAMILY) == set(SHIPPED)  # a new config/models/*.yaml states its family here
    for name, cfg in SHIPPED.items():
        assert families.of(cfg) is FAMILY[name], name


def test_the_table_is_written_once_and_every_family_fills_every_field():
    assert families.FAMILIES == {"deepseek_v2": deepseek.FAMILY, "deepseek_v3": deepseek.FAMILY,
                                 "deepseek_v4": deepseek_v4.FAMILY}
    for family in set(families.FAMILIES.values()):
        for f in dataclasses.fields(family):
            assert getattr(family, f.name) is not None or f.name == "own_layer", (family.name, f.name)
        assert all(families.FAMILIES[t] is family for t in family.architectures)


def test_a_config_naming_no_model_type_is_deepseek_v2_as_the_engine_reads_it():
    assert families.of({}) is families.of({"model_type": None}) is deepseek.FAMILY
    plain = {k: v for k, v in TINY.items() if k != "model_type"}
    assert families.model_type(plain) == "deepseek_v2" == args_from_hf(plain).model_type


def test_an_unknown_model_type_is_refused_naming_it_and_the_known_ones(tmp_path):
    with pytest.raises(families.UnknownFamily, match=r"model_type 'llama' .*known: deepseek_v2, deepseek_v3, "
                                                     r"deepseek_v4"):
        families.of({"model_type": "llama"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(families.UnknownFamily, match="'qwen3_moe'"):
        families.of_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="'qwen3_moe'"):  # an UnknownFamily is a ValueError: callers' errors
        families.load(tmp_path)


def test_a_checkpoint_is_read_through_the_engine_reader(tmp_path):
    for cfg in (TINY, V4_TINY):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        family, args = families.load(tmp_path)
        assert family is families.of_checkpoint(tmp_path) is families.of(cfg)
        assert args == args_from_hf(cfg) == family.load(tmp_path)


# --- what each family answers -------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILY))
def test_config_fields_and_reading(name):
    cfg, family = SHIPPED[name], FAMILY[name]
    assert set(cfg) <= family.keys, sorted(set(cfg) - family.keys)
    assert family.args(cfg) == args_from_hf(cfg)
    assert family.tiny in SHIPPED and families.of(SHIPPED[family.tiny]) is family
    assert set(required_fields(cfg.get("model_type"))) <= set(SHIPPED[family.tiny])
    assert {"kv_lora_rank" in family.keys, "compress_rates" in family.keys} == {True, False}  # its own fields only


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_size_estimate_is_the_familys_count(name):
    cfg, family = SHIPPED[name], FAMILY[name]
    assert estimate.parameters(cfg) == family.parameters(family.args(cfg)) > 0


@pytest.mark.parametrize("name", ["tiny", "tiny-mla576", "deepseek-v4-tiny"])
def test_the_count_and_the_checkpoint_names_are_transformers_models(name):
    """The family's count against the tensors the writer writes (checkpoints.parameter_shapes: transformers' model
    on the meta device, under the family's saved_state names)."""
    pytest.importorskip("transformers")
    cfg, family = checkpoints.full_config(SHIPPED[name], "float32"), FAMILY[name]
    shapes = checkpoints.parameter_shapes(cfg)
    assert sum(map(_numel, shapes.values())) == family.parameters(family.args(cfg))
    per_expert = any(re.search(r"experts\.\d+\.gate_proj\.weight$", n) for n in shapes)
    assert per_expert == (family is deepseek.FAMILY)  # V2/V3: the original per-expert names
    assert cfg["architectures"] == [family.architectures[families.model_type(cfg)]]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def campaign(**over) -> dict:
    """A resolved campaign's keys that a family's problems read, asking for every path and backend."""
    cfg = {"stages": ["parity", "bench", "profile"],
           "parity": {"backends": list(runs.BACKENDS), "kernels": ["torch", "triton", "graph"]},
           "bench": {"backends": ["single", *runs.EP_BACKENDS, *runs.HF_PATHS, "hf-static"], "kernels": "triton",
                     "prompts": ["a", "b"]}}
    return {**cfg, **over}


def test_supported_decode_paths_and_backends():
    assert deepseek.FAMILY.problems(campaign()) == []  # the engine runs every path and backend on V2/V3
    refused = dict(deepseek_v4.FAMILY.problems(campaign()))
    assert set(refused) == {"parity.backends", "bench.backends", "parity.kernels", "bench.kernels", "bench.prompts"}
    assert "without expert parallelism" in refused["parity.backends"] and "triton" in refused["bench.kernels"]
    torch_only = campaign(parity={"backends": ["single"], "kernels": ["torch", "graph"]},
                          bench={"backends": ["single", "hf"], "kernels": "graph", "prompts": None})
    assert deepseek_v4.FAMILY.problems(torch_only) == []


def test_the_kernel_audits_shapes():
    mla = deepseek.FAMILY.audit(deepseek.FAMILY.args(TINY))
    h, inter, moe = TINY["hidden_size"], TINY["intermediate_size"], TINY["moe_intermediate_size"]
    assert mla == {"k": sorted({h, TINY["kv_lora_rank"], 4 * TINY["v_head_dim"], moe, inter}), "vocab": 512,
                   "experts": (h, moe, 8, 2), "options": {}, "not_covered": {}}
    lite = deepseek.FAMILY.audit(deepseek.FAMILY.args(SHIPPED["deepseek-v2-lite"]))
    assert lite["k"] == [512, 1408, 2048, 2816, 10944] and lite["vocab"] == 102400  # tests/test_kernel_audit.py's
    v4 = deepseek_v4.FAMILY.audit(deepseek_v4.FAMILY.args(V4_TINY))
    h = V4_TINY["hidden_size"]
    assert v4["k"] == sorted({h, V4_TINY["q_lora_rank"], 4 * 32 // 2, 2 * 16, V4_TINY["moe_intermediate_size"], 4 * h})
    assert v4["vocab"] == 512 and v4["experts"] == (h, 32, 8, 2)
    assert set(deepseek_v4.NOT_COVERED) <= set(v4["not_covered"])
    assert set(v4["options"]) <= {"limit", "hc"} and v4["options"].get("limit", 10.0) == 10.0


@pytest.mark.parametrize("name", ["tiny", "tiny-mla576", "deepseek-v4-tiny"])
def test_the_floors_layout(name):
    family = FAMILY[name]
    args = family.args(SHIPPED[name])
    lay = Layout(**family.layout(args, torch.bfloat16))
    assert len(lay.expert) and lay.top_k == args.num_experts_per_tok and lay.n_experts == args.n_routed_experts
    step = lay.step([10, 20])
    assert step["total"] == step["weights"] + step["chosen_experts"] + step["embedding_rows"] + step["cache"] > 0
    if family is deepseek.FAMILY:  # the latent cache: every layer, P x (kv_lora_rank + qk_rope_head_dim)
        assert lay.cache_row(10) == 10 * args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
        assert lay.per_row == 0
    else:  # a hash layer's tid2eid row, k int64 ids; the cache by deepseek_v4.cache_bytes
        assert lay.per_row == 1 * args.num_experts_per_tok * 8
        assert lay.cache_row(10) == deepseek_v4.cache_bytes(args, 10, 2)


def test_the_overlap_screens_fields_and_whether_it_needs_the_checkpoint():
    assert deepseek.FAMILY.overlap_fields(TINY) is None and deepseek.FAMILY.own_layer is None
    assert deepseek_v4.FAMILY.overlap_fields(V4_TINY) == {"hidden_size": 64, "head_dim": 32, "index_head_dim": 16,
                                                          "index_n_heads": 8, "q_lora_rank": 32}
    no_c4 = {**V4_TINY, "layer_types": ["sliding_attention", *["heavily_compressed_attention"] * 2]}
    assert deepseek_v4.FAMILY.overlap_fields(no_c4) is None
    assert deepseek_v4.FAMILY.overlap_fields(SHIPPED["deepseek-v4-flash"])["hidden_size"] == 4096
    assert callable(deepseek_v4.FAMILY.own_layer)
    stated = {**TINY, "compress_ratios": [0, 4, 128], "head_dim": 128, "index_head_dim": 32, "index_n_heads": 16,
              "q_lora_rank": 256}  # compressor fields under no model_type of their own: read as stated
    assert deepseek.FAMILY.overlap_fields(stated)["head_dim"] == 128
    with pytest.raises(ValueError, match="but not index_n_heads"):
        deepseek.FAMILY.overlap_fields({k: v for k, v in stated.items() if k != "index_n_heads"})


def test_the_checkpoint_records_mtp_skip_and_training_pads():
    assert "DeepSeek-V3" in deepseek.FAMILY.mtp_skip and "mtp.*" in deepseek_v4.FAMILY.mtp_skip
    assert deepseek.FAMILY.pads_values and not deepseek_v4.FAMILY.pads_values


# --- workflow code asks the family and names none ------------------------------------------------

FAMILY_NAME = re.compile(r"deepseek_v\d|(^|_)v\d($|_)|V\dArgs|^V\d$", re.IGNORECASE)
# model_type values, the engine's family-specific names, as an identifier or a compared/listed string
ENGINE_NAMES = {"V4", "V4Args", "ModelArgs", "ROUTINGS", "CSA", "HCA", "SLIDING", "HASH_MOE", "MOE", "LAYER_TYPES"}


def family_names(path: Path) -> list[str]:
    """Where a workflow module names a family in code (not in its docstrings or messages): an engine family name
    imported or used, an identifier like is_v4 or v4_layout, a string equal to a model_type."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evident.engine"):
            out += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in ENGINE_NAMES]
            if FAMILY_NAME.search(node.module.rpartition(".")[2]):
                out.append(f"{node.lineno}: imports {node.module}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and FAMILY_NAME.search(node.name):
            out.append(f"{node.lineno}: defines {node.name}")
        elif isinstance(node, ast.Name) and FAMILY_NAME.search(node.id):
            out.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and FAMILY_NAME.search(node.attr):
            out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in families.FAMILIES:
            out.append(f"{node.lineno}: {node.value!r}")
    return out


def test_workflow_code_outside_the_families_names_none():
    found = {}
    for path in sorted((ROOT / "workflow").rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("workflow/models/families/") or path.suffix not in (".py", ".smk"):
            continue
        if path.suffix == ".py":
            hits = family_names(path)
        else:  # a rule file: its Python lines, comments left out
            hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                    if re.search(r"deepseek_v\d|\bV\d\b|V\dArgs|is_v\d", line.split("#")[0])]
        if hits:
            found[rel] = hits
    assert found == {}


def test_the_check_sees_a_family_named_in_code(tmp_path):
    src = tmp_path / "x.py"
    src.write_text('"""DeepSeek-V4 in a docstring is fine."""\nfrom evident.engine.config import V4\n'
                   'def v4_layout(a):\n    return a.model_type == "deepseek_v4" or is_v4\n')
    assert [h.split(":")[0] for h in family_names(src)] == ["2", "3", "4", "4"]
