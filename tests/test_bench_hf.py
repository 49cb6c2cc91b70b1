"""The benchmark's `hf` backend: transformers' own greedy generate, marked once per new token, on the
engine's prompt ids (so its figures stand beside the engine's in the same run)."""
import pytest
import torch

pytest.importorskip("transformers")

from test_engine_kernels import MICRO, PROMPT  # noqa: E402
from test_engine_parity import hf_generate as hf_reference  # noqa: E402
from test_engine_parity import hf_model  # noqa: E402

from evident.workflow.stages.bench import hf_generate  # noqa: E402


def test_hf_backend_marks_every_token_and_decodes_greedily():
    hf = hf_model(MICRO)
    marks = []
    with torch.inference_mode():
        gen = hf_generate(hf, [PROMPT] * 3, 6, progress=lambda *_: marks.append(len(marks)))
    assert len(marks) == 6  # one mark per new token: the prefill's first, then each decode step
    assert gen.tokens == [hf_reference(hf, PROMPT, 6)] * 3
    # exactly the contract's count, even where the model would emit EOS first
    eos = gen.tokens[0][1]
    hf.generation_config.eos_token_id = eos
    with torch.inference_mode():
        assert [len(r) for r in hf_generate(hf, [PROMPT], 6, progress=lambda *_: None).tokens] == [6]


def test_each_transformers_path_is_its_own_cell_on_its_own_experts(tmp_path):
    """hf, hf-grouped and hf-static load transformers' model with the path's experts, decode the same greedy tokens
    (float32), and the stage writes a cell per path with its warm-up recorded apart from the repeats; and the
    distinct-prompts cells of each path, its rows left-padded, each row as its prompt alone."""
    import tinyev

    from evident.workflow.core.evidence import read_json, write_json
    from evident.workflow.models.session import open_session
    from evident.workflow.plan import environment
    from evident.workflow.plan.runs import HF_PATHS
    from evident.workflow.stages import bench

    cfg = tinyev.config(bench={"backends": list(HF_PATHS), "batch_sizes": [1, 2], "prompt": "Hi", "new_tokens": 4,
                               "warmup": 1, "repeats": 1, "prompts": ["Hi", "A longer prompt, padded beside Hi"]})
    ckpt, ev = tinyev.make(tmp_path, cfg)
    write_json(ev / "env.json", environment.describe("cpu"))  # the context stage's, which the cells cite
    tokens = {}
    for backend, (load, options) in HF_PATHS.items():
        with open_session(ckpt, ev, backend) as s:
            assert s.model.config._experts_implementation == load["experts_implementation"]
            with torch.inference_mode():
                tokens[backend] = hf_generate(s.model, [[5, 9, 2, 7]] * 2, 5, progress=lambda *_: None,
                                              **options).tokens
        bench.main(["--checkpoint", str(ckpt), "--evidence", str(ev), "--backend", backend, "--batch-sizes", "1,2"])
        for b in (1, 2):
            cell = read_json(ev / f"bench/{backend}-b{b}.json")
            assert cell["backend"] == backend and len(cell["warmup_wall_s"]) == 1
            assert cell["first_warmup_over_repeat_s"] == cell["warmup_wall_s"][0] - cell["repeats"][0]["wall_s"]
        distinct = read_json(ev / f"bench/{backend}-distinct-b2.json")
        assert distinct["rows_check"]["verdict"] == "rows_as_alone" and distinct["contract"]["padding"]
        assert distinct["floor"]["unique_experts"]["max"] >= distinct["floor"]["unique_experts"]["top_k"]
    assert tokens["hf-grouped"] == tokens["hf"] and tokens["hf-static"] == tokens["hf"]
